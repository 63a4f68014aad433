"""The docs' parts that the code owns, written into the Markdown files themselves, so that a page reads the
same on the repository as on the site: ``python3 tasks.py docs`` runs this before the site's build, and
``tests/test_docs.py`` fails when a file is not what it would write.

A block between ``<!-- generated: NAME -->`` and ``<!-- /generated -->`` lines is rewritten whole:

- ``options``: a table of ``Options``' fields, each with its default and its description from the class
  docstring's ``Attributes:`` section (written there once);
- ``metrics``: a table of every metric name of ``flops_callbacks/metrics.py``, with its unit and the
  comment it is defined with: a name added there is on the page at the next run;
- ``console``: the demo's console summary, ``docs/snippets/console.txt`` (``python3 tasks.py console``
  runs the demo and writes it);
- ``benchmarks``: ``benchmarks/README.md`` below its title, its links into ``docs/`` made the site's;
- ``step_profiler``: a table of ``StepProfiler``'s own arguments, from its docstring's ``Args:`` section.

A number between ``<!-- plan: NAME -->`` and ``<!-- /plan -->`` is the constant ``NAME`` of
``flops_callbacks/session/window_plan.py`` (the window's layout); ``BEFORE_CLEAN`` is the steps before the
clean ones in one process, ``CHECK_AFTER`` the steps from the counting step to the check in one process.
Importable without mkdocs (the tests read the same tables).

    python docs/generate.py          # rewrite what is stale, name each file rewritten
    python docs/generate.py --check  # exit 1 naming each stale file, write nothing
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's package, whichever one is installed

from flops_callbacks import metrics  # noqa: E402
from flops_callbacks.options import Options  # noqa: E402

__all__ = [
    "BENCHMARKS",
    "benchmarks_markdown",
    "CONSOLE",
    "console_markdown",
    "files",
    "generated",
    "metric_names",
    "metrics_markdown",
    "option_descriptions",
    "options_markdown",
    "stale",
    "step_profiler_markdown",
    "unit",
]

CONSOLE = ROOT / "docs" / "snippets" / "console.txt"
BENCHMARKS = ROOT / "benchmarks" / "README.md"
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- /generated -->)", re.DOTALL)
PLAN = re.compile(r"(<!-- plan: (\w+) -->)(.*?)(<!-- /plan -->)")
# a metric's unit, by the end of its name (the first that matches)
UNITS = (
    ("per_joule", "tokens/J"),
    ("energy_per_step", "J"),
    ("energy_per_sample", "J"),
    ("energy_per_token", "J"),
    ("energy", "J"),
    ("power", "W"),
    ("flops_per_sec", "flop/s"),
    ("samples_per_sec", "samples/s"),
    ("tokens_per_sec", "tokens/s"),
    ("flops_per_token", "flop"),
    ("bytes_per_token", "byte"),
    ("latency_per_token", "s"),
    ("latency_p90", "s"),
    ("time_to_first_token", "s"),
    ("latency", "s"),
    ("seconds", "s"),
    ("flops", "flop"),
    ("macs", "MAC"),
    ("bytes", "byte"),
    ("fraction", "fraction"),
    ("overlap", "fraction"),
    ("busy_fwd", "fraction"),
    ("busy_bwd", "fraction"),
    ("busy_step", "fraction"),
    ("device_idle", "fraction"),
    ("mfu", "fraction"),
    ("hfu", "fraction"),
    ("mbu", "fraction"),
    ("params", "count"),
    ("steps", "count"),
    ("slow_rank", "rank"),
    ("report", "text"),
    ("profile", "HTML"),
)


def _section(doc: str | None, title: str, indent: str) -> dict[str, str]:
    """Each entry of a Google-style docstring's ``title`` section (``Attributes``, ``Args``), its
    description joined into one line; ``indent``: the entries' indent after ``inspect.cleandoc``."""
    section = inspect.cleandoc(doc or "").split(f"{title}:", 1)[1]
    found: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        entry = re.match(rf"^{indent}(\**\w+): (.*)$", line)
        if entry:
            name = entry[1]
            found[name] = entry[2]
        elif line.startswith(indent + "    ") and name is not None:
            found[name] += " " + line.strip()
        elif line.strip():
            break  # the next section
    return found


def option_descriptions() -> dict[str, str]:
    """Each option's description, from ``Options``' ``Attributes:`` section, joined into one line."""
    return _section(Options.__doc__, "Attributes", "    ")


def _code(text: str) -> str:
    """reST's ``literal`` as Markdown's `literal`."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def options_markdown() -> str:
    """The options table; a field without a description (or a description of no field) is an error."""
    fields = list(dataclasses.fields(Options))
    described = option_descriptions()
    names = [f.name for f in fields]
    if set(described) != set(names):
        raise ValueError(
            f"Options' docstring and fields differ: undescribed {sorted(set(names) - set(described))}, "
            f"described but no field {sorted(set(described) - set(names))}"
        )
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for f in fields:
        rows.append(f"| `{f.name}` | `{f.default!r}` | {_code(described[f.name])} |")
    return "\n".join(rows)


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """Line number -> the text of the comment on it; and the lines that hold nothing but a comment."""
    comments, alone = {}, set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
            if token.line.strip().startswith("#"):
                alone.add(token.start[0])
    return comments, alone


def _assignments() -> list[tuple[str, Any, str]]:
    """(name, value, comment) of each module-level constant of metrics.py, in source order; the comment is
    the one on its line, else the comment lines right above it."""
    source = Path(metrics.__file__).read_text()
    comments, alone = _comments(source)
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not isinstance(target, ast.Name):
            continue
        comment = comments.get(node.lineno, "")
        if not comment:
            above, line = [], node.lineno - 1
            while line in alone:
                above.insert(0, comments[line])
                line -= 1
            comment = " ".join(above)
        found.append((target.id, getattr(metrics, target.id), comment))
    return found


def metric_names() -> list[str]:
    """Every metric name metrics.py defines (string constants with a ``/``; prefixes left out)."""
    return [value for _, value, _ in _assignments() if _is_name(value)]


def _is_name(value: object) -> bool:
    return isinstance(value, str) and "/" in value and not value.endswith("/")


def unit(name: str) -> str:
    """A metric's unit, from the end of its name; ValueError for a name no unit fits.

    Args:
        name: the metric's name.
    """
    leaf = name.rsplit("/", 1)[-1]
    found = next((unit for end, unit in UNITS if leaf.endswith(end)), None)
    if found is None:
        raise ValueError(f"docs: no unit for the metric {name!r}: add its name's end to UNITS in {__file__}")
    return found


def metrics_markdown() -> str:
    """The metrics table: each name, its unit and what it means."""
    rows = ["| name | unit | meaning |", "| --- | --- | --- |"]
    for _, value, comment in _assignments():
        if _is_name(value):
            rows.append(f"| `{value}` | {unit(value)} | {comment} |")
    return "\n".join(rows)


def step_profiler_markdown() -> str:
    """``StepProfiler``'s own arguments (the options are the options table's): each with its default and
    its description from the class docstring's ``Args:`` section."""
    from flops_callbacks.integrations.step_profiler import StepProfiler

    described = _section(StepProfiler.__doc__, "Args", "    ")
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for name, parameter in inspect.signature(StepProfiler).parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            continue  # the options, on their own page
        if name not in described:
            raise ValueError(f"StepProfiler's docstring does not describe its argument {name!r}")
        default = "required" if parameter.default is parameter.empty else f"`{parameter.default!r}`"
        rows.append(f"| `{name}` | {default} | {_code(described[name])} |")
    return "\n".join(rows)


def console_markdown() -> str:
    """The demo's console summary as a fenced block."""
    return f"```text\n{CONSOLE.read_text()}```"


def benchmarks_markdown() -> str:
    """The benchmarks' README below its title, its links into the docs as the site's pages link."""
    _title, body = BENCHMARKS.read_text().split("\n", 1)
    return body.strip("\n").replace("](../docs/", "](")


BLOCKS: dict[str, Callable[[], str]] = {
    "options": options_markdown,
    "metrics": metrics_markdown,
    "console": console_markdown,
    "benchmarks": benchmarks_markdown,
    "step_profiler": step_profiler_markdown,
}


def _plan(name: str) -> str:
    from flops_callbacks.session import window_plan

    if name == "BEFORE_CLEAN":  # one process: the head and the check
        return str(window_plan.before_clean())
    if name == "CHECK_AFTER":  # one process: the check comes right after the head
        return str(len(window_plan.head()))
    if not hasattr(window_plan, name):
        raise ValueError(f"docs: flops_callbacks.session.window_plan has no {name} (the window's layout)")
    return str(getattr(window_plan, name))


def generated(text: str) -> str:
    """``text`` with every marked block and number as the code says it now.

    Args:
        text: a Markdown file's text.
    """

    def block(found: re.Match[str]) -> str:
        if found[2] not in BLOCKS:
            raise ValueError(f"docs: no generated block {found[2]!r} (known: {', '.join(BLOCKS)})")
        return f"{found[1]}{BLOCKS[found[2]]()}\n{found[4]}"

    text = BLOCK.sub(block, text)
    return PLAN.sub(lambda found: f"{found[1]}{_plan(found[2])}{found[4]}", text)


def files() -> list[Path]:
    """The Markdown files that may hold generated parts: the README and the docs' pages."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def stale() -> list[Path]:
    """The files whose generated parts are not what :func:`generated` writes."""
    return [path for path in files() if generated(path.read_text()) != path.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="name the stale files and exit 1; write nothing")
    args = parser.parse_args(argv)
    found = stale()
    for path in found:
        if args.check:
            print(f"stale: {path.relative_to(ROOT)} (python3 tasks.py docs rewrites it)")
        else:
            path.write_text(generated(path.read_text()))
            print(f"rewrote {path.relative_to(ROOT)}")
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
