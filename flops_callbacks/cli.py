"""The command line, ``flops-callbacks`` (or ``python -m flops_callbacks``): show, diff and gate saved
profiles (the ``flops_profile_step{N}.json`` a profiled run writes, or a generation's saved profile).

An entry point over the reporting layer and the generation room, and a reader of their JSON and nothing
more: files are read by :mod:`~flops_callbacks.reporting.profile_file` (a generation's by
:mod:`~flops_callbacks.generation.json_file`), the report printed by the renderers the live run printed
it with (:mod:`~flops_callbacks.reporting.publish`), figures compared by
:mod:`~flops_callbacks.reporting.compare`, pictures drawn by :mod:`~flops_callbacks.reporting.picture`.
It imports no framework. Exit codes: 0 done (or the gate passed), 1 the gate failed, 2 bad input (a
missing file, a file that is not a profile, an unknown figure, a bad rule: argparse's code for usage
errors too). Colours only on a terminal (and never with ``NO_COLOR`` set), so CI logs stay plain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO, cast

from flops_callbacks.communication.slow_rank_report import slow_rank_text
from flops_callbacks.files import write_text
from flops_callbacks.generation.json_file import read_generation
from flops_callbacks.generation.report import generation_picture, render_generation
from flops_callbacks.options import Options
from flops_callbacks.reporting.compare import (
    NAMING,
    Change,
    Figure,
    ModuleChange,
    changes,
    figure_text,
    module_changes,
    one_sided,
    one_sided_lines,
    own_seconds,
    percent_text,
    range_text,
)
from flops_callbacks.reporting.gate_rules import Rule, gate
from flops_callbacks.reporting.picture import render_html
from flops_callbacks.reporting.profile_file import SavedProfile, load, load_runs
from flops_callbacks.reporting.publish import picture
from flops_callbacks.reporting.run_notes import setup_note, varying_note, work_note
from flops_callbacks.reporting.tree_check import TreeCheck
from flops_callbacks.reporting.window_rows import report_text, tree_doubts
from flops_callbacks.units import bytes_to_string, duration_to_string, number_to_string

__all__ = ["main"]

PROG = "flops-callbacks"
EXIT_OK, EXIT_WORSE, EXIT_BAD_INPUT = 0, 1, 2


class _Paint:
    """ANSI colours for a terminal; plain text elsewhere."""

    def __init__(self, mode: str, out: TextIO) -> None:
        tty = hasattr(out, "isatty") and out.isatty()
        self.on = mode == "always" or (mode == "auto" and tty and not os.environ.get("NO_COLOR"))

    def __call__(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.on and text else text


RED, GREEN, DIM, BOLD = "31", "32", "2", "1"


class _Reader:
    """The output, which a reader that stops early (``| head``) may close: the rest is dropped and the
    exit code stays the command's (a gate's verdict is not an error of writing it)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.gone = out, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.out.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.out.flush()
            except BrokenPipeError:
                self._gone()

    def isatty(self) -> bool:
        return hasattr(self.out, "isatty") and self.out.isatty()

    def _gone(self) -> None:
        """No more writes; the stream's descriptor pointed at /dev/null, so that the interpreter's last
        flush at exit does not fail on the closed pipe (what Python's docs advise for SIGPIPE)."""
        self.gone = True
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor: nothing to flush
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.out.fileno())
            finally:
                os.close(devnull)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line on ``argv`` (``sys.argv[1:]`` by default); returns the exit code."""
    reader = _Reader(out or sys.stdout)
    writes = cast(TextIO, reader)  # what the commands print to: a text stream as print() uses one
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args, writes, _Paint(args.color, writes)))
    except (ValueError, OSError) as error:  # ProfileFileError, a bad rule, an unknown figure, bad --html
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        reader.flush()  # here, not at the interpreter's exit, where a closed pipe would change the code


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low`` (argparse names the option and the value it refused)."""

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}")
        return value

    return read


def _write_page(path: str, text: str) -> None:
    """``--html OUT`` written (its folder made if missing); ValueError naming the option when it cannot be."""
    try:
        write_text(path, text)
    except OSError as error:
        raise ValueError(f"--html {path}: cannot be written ({error.strerror or error})") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Show, compare and gate saved flops profiles.")
    commands = parser.add_subparsers(dest="command", required=True)

    show = commands.add_parser("show", help="print a profile's report again")
    show.add_argument("profile", help="a flops_profile_step{N}.json, or a generation's saved profile")
    show.add_argument("--html", metavar="OUT", help="also write the profile's picture to OUT")
    show.add_argument(
        "--module-depth", type=_at_least(-1),
        help="depth of the module tree (-1: all; default: the run's report's, or all)",
    )  # fmt: skip
    show.add_argument(
        "--top-modules", type=_at_least(1),
        help="modules per depth in the aggregated profile (default: the run's report's, or 1)",
    )  # fmt: skip
    show.add_argument("--brief", action="store_true", help="leave the detailed module tree out")
    show.set_defaults(run=_show)

    diff = commands.add_parser("diff", help="compare two profiles: headline figures, then modules")
    diff.add_argument("a", help="the profile compared against (e.g. main's)")
    diff.add_argument("b", help="the profile compared")
    diff.add_argument(
        "--top", type=_at_least(0), default=10, help="modules listed (default 10; 0: the figures alone)"
    )
    diff.add_argument("--html", metavar="OUT", help="write B's picture coloured by its change against A")
    diff.add_argument("--json", action="store_true", help="print the comparison as JSON")
    diff.set_defaults(run=_diff)

    gate_ = commands.add_parser("gate", help="exit 1 when a figure of NEW got worse than BASE's")
    runs = "or a folder of several runs' profiles (each flops_profile_step{N}.json under it)"
    gate_.add_argument("base", help=f"the reference profile (e.g. main's), {runs}")
    gate_.add_argument("new", help=f"the profile checked (e.g. the pull request's), {runs}")
    gate_.add_argument(
        "--fail-on", action="append", required=True, metavar="FIGURE:+N%|FIGURE:-N%",
        help="fail when FIGURE (a metric name without flops_profiler/) grows (+) or falls (-) by more "
        "than N percent and beyond BASE's range (over its clean steps; over its runs for a folder); "
        "repeatable",
    )  # fmt: skip
    gate_.add_argument("--json", action="store_true", help="print the checks as JSON")
    gate_.set_defaults(run=_gate)

    for sub in (show, diff, gate_):
        sub.add_argument(
            "--color", choices=("auto", "always", "never"), default="auto",
            help="colours: on a terminal without NO_COLOR set (auto, the default), always or never",
        )  # fmt: skip
    return parser


# --- show -------------------------------------------------------------------------------------------


def _show(args: argparse.Namespace, out: TextIO, paint: _Paint) -> int:
    given = {"module_depth": args.module_depth, "top_modules": args.top_modules}
    given = {k: v for k, v in given.items() if v is not None}  # else the run's report's, or the defaults
    generation = read_generation(args.profile)  # a generation's profile, or None: a window's
    if generation is not None:
        options = Options(**given)
        text = render_generation(
            generation, options.module_depth, detailed=not args.brief, top_modules=options.top_modules
        )
        print(text, file=out)
        if args.html:
            _write_page(args.html, generation_picture(generation))
        return EXIT_OK
    saved = load(args.profile)
    options = Options(**{**saved.report, **given})
    print(report_text(saved.result, options, detailed=not args.brief), file=out)
    if args.html:
        _write_page(args.html, picture(saved.result))
    return EXIT_OK


# --- diff -------------------------------------------------------------------------------------------


def _window(path: str) -> SavedProfile:
    """A training window's profile; a generation's is refused with what reads it (``show``), a folder
    with what takes one (``gate``)."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: a folder: diff compares two profile files; gate takes a folder of runs")
    if read_generation(path) is not None:
        raise ValueError(
            f"{path}: a generation's profile: diff and gate compare training windows; show prints it"
        )
    return load(path)


def _runs(path: str) -> list[SavedProfile]:
    """The training windows at ``path``: a profile file, or the runs of a folder (``load_runs``)."""
    return load_runs(path) if os.path.isdir(path) else [_window(path)]


def _diff(args: argparse.Namespace, out: TextIO, paint: _Paint) -> int:
    a, b = _window(args.a), _window(args.b)
    figures, alone, notes = changes(a, b), one_sided(a, b), _notes(a, b)
    modules = module_changes(a, b) if _shown(a) and _shown(b) else []
    if args.json:
        data = _diff_json(a, b, figures, modules)
        data["one_sided"] = [{"name": n, "in": side, "why_not_the_other": why} for n, side, why in alone]
        print(json.dumps(data, indent=2), file=out)
    else:
        print(_diff_text(a, b, notes, (figures, alone), modules[: args.top], len(modules), paint), file=out)
    if args.html:
        _write_page(args.html, _diff_html(a, b, notes, figures))
    return EXIT_OK


def _notes(a: SavedProfile, b: SavedProfile) -> list[str]:
    """Why the runs' figures do not compare as they read, each a sentence: other work, other setups,
    latencies of no clean step, module times not measured in the window."""
    notes = [note for note in (work_note(a, b), varying_note(a, b), setup_note(a, b)) if note]
    for label, saved in (("A", a), ("B", b)):
        steps = saved.result.steps
        if not steps.clean:
            notes.append(
                f"{label}'s latencies rest on no clean step (clean_steps 0: the run ended before them): they "
                "are its counting or module-timing step's, inflated by the profiler's own work, so its times "
                "and rates are not its configuration's"
            )
        if not _shown(saved):
            why = (
                f"a re-profile window: its module tree is the window's of step {steps.counting}, reused"
                if steps.reused
                else "its module-timing steps ran other batch shapes than its counting step"
            )
            notes.append(f"{label} timed no module ({why}): no module's change is shown")
        elif not steps.module_timing:
            why = "the run ended before its module-timing steps: its module times are the counting step's"
            notes.append(f"{label} timed no module ({why}, slowed by counting)")
    return notes


def _shown(saved: SavedProfile) -> bool:
    """Whether the run's module times are its window's own (not a reused tree, nor 0s of other shapes)."""
    s = saved.result.steps
    return not s.reused and (s.module_shapes_match or not s.module_timing)


def _run_line(label: str, saved: SavedProfile) -> str:
    r = saved.result
    window = f"window at step {r.step}, counts of " if r.steps.reused else ""
    steps = f"{window}counting step {r.steps.counting}, {len(r.steps.clean)} clean step(s)"
    return f"{label}: {saved.source} ({steps}, {r.profile.device})"


def _mark(change: Change) -> tuple[str, str]:
    """The word after a figure's change, and its colour."""
    if change.direction == 0:
        return "", ""
    if change.noise:
        return "noise", DIM
    return ("worse", RED) if change.direction < 0 else ("better", GREEN)


def _with_range(f: Figure) -> str:
    return figure_text(f) if f.low == f.high else f"{figure_text(f)} ({range_text(f)})"


def _table(rows: list[list[str]], plain: list[list[str]]) -> list[str]:
    """Rows in columns padded by their plain text (``rows`` may hold colour codes)."""
    widths = [max(len(row[i]) for row in plain) for i in range(len(plain[0]))]
    return [
        "  ".join(cell + " " * (w - len(p)) for cell, p, w in zip(row, prow, widths, strict=True)).rstrip()
        for row, prow in zip(rows, plain, strict=True)
    ]


def _figure_rows(figures: list[Change], paint: _Paint) -> list[str]:
    head = ["figure", "A", "B", "change", ""]
    rows, plain = [head], [head]
    for c in figures:
        moved = percent_text(c.relative) if c.relative else ("=" if c.a.value == c.b.value else "changed")
        cells = [c.name, _with_range(c.a), _with_range(c.b), moved]
        mark, colour = _mark(c)
        rows.append([*cells, paint(mark, colour)])
        plain.append([*cells, mark])
    return _table(rows, plain)


def _pair(pair: tuple[Any, Any], text: Any) -> str:
    a, b = (("absent" if v is None else text(v)) for v in pair)
    return f"= {a}" if pair[0] == pair[1] else f"{a} -> {b}"


def _module_rows(modules: list[ModuleChange], paint: _Paint) -> list[str]:
    head = ["module", "class", "own time A -> B", "change", "own flops", "own bytes", ""]
    rows, plain = [head], [head]
    for m in modules:
        delta = m.delta_seconds
        moved = ("+" if delta > 0 else "-" if delta < 0 else "") + duration_to_string(abs(delta))
        cells = [
            m.name or "(model)",
            m.class_name,
            _pair(m.seconds, duration_to_string),
            moved,
            _pair(m.flops, lambda v: number_to_string(v).strip()),
            _pair(m.bytes, bytes_to_string),
        ]
        mark = "noise" if m.noise else ""
        rows.append([*cells, paint(mark, DIM)])
        plain.append([*cells, mark])
    return _table(rows, plain)


def _diff_text(
    a: SavedProfile,
    b: SavedProfile,
    notes: list[str],
    figures: tuple[list[Change], list[tuple[str, str, str]]],
    modules: list[ModuleChange],
    total: int,
    paint: _Paint,
) -> str:
    """``figures``: the changes of the figures both runs have, and those one run has alone."""
    both, alone = figures
    lines = [paint("flops_callbacks diff", BOLD), _run_line("A", a), _run_line("B", b)]
    for label, saved in (("A", a), ("B", b)):  # several ranks: the rank the others wait for, or none
        if saved.result.slow_rank is not None:
            lines.append(f"slow rank, {label}: {slow_rank_text(saved.result.slow_rank)}")
    for note in notes:
        lines += ["", paint(f"NOTE: {note}.", RED)]
    lines += [
        "",
        "Headline figures: each latency as logged (the median step's) and its range over the clean steps "
        "(their fastest and slowest tenth left out), each rate over the same steps (its range: theirs as a "
        "rate); noise: B within A's range",
        *_figure_rows(both, paint),
        *one_sided_lines(alone),
        "",
        f"Modules by the change of their own time (fwd + bwd + recompute, their children's left out), "
        f"largest first: {len(modules)} of the {total} that changed; noise: within A's fwd + bwd "
        "latency ranges",
    ]
    if modules:
        lines += _module_rows(modules, paint)
    elif not (_shown(a) and _shown(b)):
        lines.append("    (left out: a run's module times are not its window's own, NOTE above)")
    elif not total:
        lines.append("    (no module changed)")
    return "\n".join(lines)


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity


def _diff_json(
    a: SavedProfile, b: SavedProfile, figures: list[Change], modules: list[ModuleChange]
) -> dict[str, Any]:
    note = work_note(a, b)
    return {
        "a": a.source,
        "b": b.source,
        "same_work": note is None,
        "work_note": note,
        "setup_note": setup_note(a, b),
        "clean_steps": {"a": len(a.result.steps.clean), "b": len(b.result.steps.clean)},
        "module_times_measured": {
            k: bool(v.result.steps.module_timing) and _shown(v) for k, v in (("a", a), ("b", b))
        },
        "figures": [
            {
                "name": c.name,
                "a": c.a.data(),
                "b": c.b.data(),
                "relative": None if c.name in NAMING else _number(c.relative),
                "noise": c.noise,
                "direction": {1: "better", -1: "worse", 0: None}[c.direction],
            }  # fmt: skip
            for c in figures
        ],
        "modules": [
            {
                "name": m.name,
                "class_name": m.class_name,
                "own_seconds": m.seconds,
                "own_flops": m.flops,
                "own_bytes": m.bytes,
                "delta_seconds": m.delta_seconds,
                "noise": m.noise,
            }  # fmt: skip
            for m in modules
        ],
    }


def _diff_html(a: SavedProfile, b: SavedProfile, notes: list[str], figures: list[Change]) -> str:
    """B's picture, each module coloured by the change of its own time against A's same-named module; by
    its achieved FLOPS where either run's module times are an earlier window's (no change to colour by)."""
    shown = ("fwd_latency", "bwd_latency", "step_latency", "iter_latency", "flops_per_sec", "mfu")
    headline = [("A (compared against)", a.source), ("B (drawn)", b.source)]
    headline += [
        (c.name.replace("_", " "), f"{figure_text(c.b)} ({percent_text(c.relative)}, A {figure_text(c.a)})")
        for c in figures
        if c.name in shown
    ]
    tree, said = tree_doubts(b.result), [f"{n}." for n in notes]
    own = own_seconds(a.result.profile)
    base = {
        name: {
            "fwd": m.fwd_latency,
            "bwd": m.bwd_latency,
            "own_fwd": own[name]["fwd"],
            "own_bwd": own[name]["bwd"],
        }
        for name, m in a.result.profile.modules.items()
        if name in b.result.profile.modules
    }
    # module times not a window's own (a reused tree): B drawn by its achieved FLOPS, no change to colour
    reused = not (_shown(a) and _shown(b))
    return render_html(
        b.result.profile,
        title=f"flops_callbacks diff: {b.source} against {a.source}",
        headline=headline,
        no_roofline=f"a diff draws no roofline (flops-callbacks show {b.source} --html OUT draws B's)",
        doubts=TreeCheck(said + tree.notes, tree.flagged) if reused else tree,
        against=None if reused else {"label": "A", "note": " ".join(said), "modules": base},
    )


# --- gate -------------------------------------------------------------------------------------------


def _gate(args: argparse.Namespace, out: TextIO, paint: _Paint) -> int:
    rules = [Rule.parse(text) for text in args.fail_on]  # before the files: a typo is said first
    base, new = _runs(args.base), _runs(args.new)
    checks = gate(base, new, rules)
    note, setup = work_note(base[0], new[0]), setup_note(base[0], new[0])
    failed = [v for v in checks if v.failed]
    code = EXIT_WORSE if failed else EXIT_OK
    if args.json:
        data = {
            "passed": not failed,
            "exit_code": code,
            "base": args.base,
            "new": args.new,
            "base_runs": [saved.source for saved in base],
            "new_runs": [saved.source for saved in new],
            "same_work": note is None,
            "work_note": note,
            "setup_note": setup,
            "checks": [v.data() for v in checks],
        }
        print(json.dumps(data, indent=2), file=out)
        return code
    for said in (note, setup):
        if said:
            print(f"{PROG} gate: note: {said}", file=sys.stderr)
    if failed:
        print(paint("FAIL", RED) + ": " + "; ".join(v.reason for v in failed), file=out)
    else:
        print(paint("ok", GREEN) + ": " + "; ".join(v.reason for v in checks), file=out)
    return code
