"""mkdocs hooks: the pages written from the code, so that the docs cannot drift from it.

- ``<!-- generated: options -->``: a table of :class:`flops_callbacks.options.Options`' fields, each with
  its default and its description from the class docstring's ``Attributes:`` section (written there once);
- ``<!-- generated: metrics -->``: a table of every metric name of :mod:`flops_callbacks.metrics` with
  the comment it is defined with, and the groups of names (the tuples) with theirs: a name added there
  is on the page at the next build;
- ``{{ window_plan.NAME }}``: a constant of :mod:`flops_callbacks.session.window_plan` (the window's numbers).

Importable without mkdocs (the tests read the same tables).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's package, whichever one is installed

from flops_callbacks import metrics  # noqa: E402
from flops_callbacks.options import Options  # noqa: E402

__all__ = ["metric_names", "metrics_markdown", "on_page_markdown", "option_descriptions", "options_markdown"]

OPTIONS_MARK = "<!-- generated: options -->"
METRICS_MARK = "<!-- generated: metrics -->"
CONSTANT = re.compile(r"\{\{\s*window_plan\.(\w+)\s*\}\}")
# a metric's unit, by the end of its name (the first that matches)
UNITS = (
    ("flops_per_sec", "flop/s"),
    ("samples_per_sec", "samples/s"),
    ("tokens_per_sec", "tokens/s"),
    ("per_sec", "1/s"),
    ("latency", "s"),
    ("seconds", "s"),
    ("flops", "flop"),
    ("macs", "MAC"),
    ("bytes", "byte"),
    ("fraction", "fraction"),
    ("mfu", "fraction"),
    ("hfu", "fraction"),
    ("params", "count"),
    ("steps", "count"),
)


def option_descriptions() -> dict[str, str]:
    """Each option's description, from ``Options``' ``Attributes:`` section, joined into one line."""
    doc = inspect.cleandoc(Options.__doc__ or "")
    section = doc.split("Attributes:", 1)[1]
    found: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        entry = re.match(r"^    (\w+): (.*)$", line)
        if entry:
            name = entry[1]
            found[name] = entry[2]
        elif line.startswith("        ") and name is not None:
            found[name] += " " + line.strip()
        elif line.strip():
            break  # the next section
    return found


def _code(text: str) -> str:
    """reST's ``literal`` as Markdown's `literal`."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def options_markdown() -> str:
    """The options table; a field without a description (or a description of no field) is an error."""
    fields = [f for f in dataclasses.fields(Options)]
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


def _assignments() -> list[tuple[str, int, Any, str]]:
    """(name, line, value, comment) of each module-level constant of metrics.py, in source order; the
    comment is the one on its line, else the comment lines right above it."""
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
        found.append((target.id, node.lineno, getattr(metrics, target.id), comment))
    return found


def metric_names() -> list[str]:
    """Every metric name metrics.py defines (string constants with a ``/``; prefixes left out)."""
    return [value for _, _, value, _ in _assignments() if _is_name(value)]


def _is_name(value: object) -> bool:
    return isinstance(value, str) and "/" in value and not value.endswith("/")


def _unit(name: str) -> str:
    leaf = name.rsplit("/", 1)[-1]
    return next((unit for end, unit in UNITS if leaf.endswith(end)), "")


def metrics_markdown() -> str:
    """The metrics table, then the groups of names."""
    rows = ["| name | unit | meaning |", "| --- | --- | --- |"]
    groups = []
    for constant, _, value, comment in _assignments():
        if _is_name(value):
            rows.append(f"| `{value}` | {_unit(value)} | {comment} |")
        elif isinstance(value, tuple) and value and all(_is_name(v) for v in value):
            groups.append(f"- `{constant}` ({len(value)} names): {comment or 'see metrics.py'}")
    return "\n".join([*rows, "", "Groups of names (tuples in `flops_callbacks/metrics.py`):", "", *groups])


def _constant(found: re.Match[str]) -> str:
    from flops_callbacks.session import window_plan

    if found[1] == "BEFORE_CLEAN":  # one process: the head and the check
        return str(window_plan.before_clean())
    if not hasattr(window_plan, found[1]):
        raise ValueError(f"docs: flops_callbacks.session.window_plan has no {found[1]} (the window's layout)")
    return str(getattr(window_plan, found[1]))


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs' hook: fill in the generated parts of a page."""
    if OPTIONS_MARK in markdown:
        markdown = markdown.replace(OPTIONS_MARK, options_markdown())
    if METRICS_MARK in markdown:
        markdown = markdown.replace(METRICS_MARK, metrics_markdown())
    return CONSTANT.sub(_constant, markdown)
