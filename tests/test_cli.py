"""The command line on real runs' files (tests/saved_runs.py: A, A2 the same configuration, B with
the module ``slow`` slowed by SLOWER seconds, C with twice the batch): its ``main`` in this process, and
as a real process, ``python -m flops_callbacks`` and the ``flops-callbacks`` console script's entry point.

``show`` prints the report the run printed; ``diff A B`` names the slowed module first; ``gate`` exits 1
on B, 0 on A2 and 2 on bad input, naming it; no colour when the output is not a terminal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from flops_callbacks.cli import main
from flops_callbacks.communication.slow_rank import find_slow_rank
from flops_callbacks.reporting.compare import figures
from flops_callbacks.reporting.profile_file import json_data, load
from tests.communication.test_slow_rank import forward_sleep
from tests.reporting.test_compare import rewritten
from tests.saved_runs import BATCH, SLOWER

ROOT = Path(__file__).resolve().parents[1]
ANSI = "\033["


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command line's ``main`` on ``args`` in this process, what it prints and its exit code caught as
    a process's would be (argparse's errors exit through ``SystemExit``). The process around it (the
    module's and the console script's entry, the exit code, a closed pipe) is tested apart, with ``run``:
    each such process spends seconds importing torch."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit:
            code = exit.code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run(*args: str, entry: str = "module", timeout: float = 120) -> subprocess.CompletedProcess:
    """The command line in a process of its own (its whole group killed if it outlives ``timeout``):
    ``python -m flops_callbacks``, or the console script's entry point as its wrapper calls it."""
    if entry == "module":
        return in_group([sys.executable, "-m", "flops_callbacks", *args], timeout)
    # what pip's console-script wrapper does: sys.exit(main()), with the arguments in sys.argv
    call = f"import sys; from pkgutil import resolve_name; sys.exit(resolve_name({entry!r})())"
    return in_group([sys.executable, "-c", call, *args], timeout)


def in_group(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``command`` run from the repository, its process group killed if it outlives ``timeout``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_show_prints_the_report_the_run_wrote_and_its_picture(runs: dict[str, Path], tmp_path: Path) -> None:
    page = tmp_path / "a.html"
    done = cli("show", str(runs["A"]), "--html", str(page))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == runs["A"].with_suffix(".txt").read_text()  # the report, every line of it
    assert page.read_text() == runs["A"].with_suffix(".html").read_text()


def module_rows(text: str) -> list[list[str]]:
    """The module table of ``diff``'s text: each row's columns (split on runs of 2+ spaces)."""
    lines = text.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("Modules by the change of their own time")
    )
    assert re.split(r" {2,}", lines[start + 1]) == [
        "module",
        "class",
        "own time A -> B",
        "change",
        "own flops",
        "own bytes",
    ]
    return [re.split(r" {2,}", line) for line in lines[start + 2 :]]


def test_diff_names_the_slowed_module_first_by_its_own_time(runs: dict[str, Path]) -> None:
    done = cli("diff", str(runs["A"]), str(runs["B"]))
    assert (done.returncode, done.stderr) == (0, "")
    assert ANSI not in done.stdout  # not a terminal: no colours
    assert "NOTE" not in done.stdout  # the same work: times are comparable
    first = module_rows(done.stdout)[0]
    # the slowed module's own time, not its parent's (the model's time grew by as much)
    assert first[:2] == ["slow", "Pause"] and first[3].startswith("+") and first[3].endswith(" ms")
    assert 0.66 * SLOWER * 1e3 <= float(first[3][1:-3]) <= 2 * SLOWER * 1e3
    # its own flops and bytes (its Linear's left out), the same in both runs: the ReLU's 4 x 32 forward
    # and 4 x 32 backward flops; it reads and writes 512 B forward, reads 1 KB and writes 512 B backward
    assert first[4:6] == ["= 256", "= 2.56 KB"]
    assert len(first) == 6  # not marked noise
    fwd = next(line for line in done.stdout.splitlines() if line.startswith("fwd_latency "))
    assert fwd.endswith("worse")

    data = json.loads(cli("diff", str(runs["A"]), str(runs["B"]), "--json").stdout)
    slow = data["modules"][0]
    assert (slow["name"], slow["noise"], data["same_work"]) == ("slow", False, True)
    assert data["module_times_measured"] == {"a": True, "b": True}
    assert 0.66 * SLOWER <= slow["delta_seconds"] <= 2 * SLOWER
    assert slow["own_flops"] == [256, 256] and slow["own_bytes"] == [2560, 2560]
    figures = {f["name"]: f for f in data["figures"]}
    assert figures["fwd_latency"]["direction"] == "worse" and not figures["fwd_latency"]["noise"]
    assert figures["fwd_flops"]["relative"] == 0 and figures["fwd_flops"]["direction"] is None


def test_diff_top_0_lists_the_figures_alone(runs: dict[str, Path]) -> None:
    done = cli("diff", str(runs["A"]), str(runs["B"]), "--top", "0")
    assert done.returncode == 0 and "fwd_latency" in done.stdout
    last = done.stdout.splitlines()[-1]
    assert last.startswith("Modules by the change of their own time") and ": 0 of the " in last
    assert "(no module changed)" not in done.stdout


def test_diff_of_runs_that_did_other_work_says_so_first(runs: dict[str, Path]) -> None:
    done = cli("diff", str(runs["A"]), str(runs["C"]))
    lines = done.stdout.splitlines()
    note = next(i for i, line in enumerate(lines) if line.startswith("NOTE: the runs did different work"))
    assert note < next(i for i, line in enumerate(lines) if line.startswith("Headline figures"))
    assert f"samples per device {BATCH} -> {2 * BATCH}" in lines[note]
    assert "(+100.0%;" in lines[note]  # every op of this model scales with the batch


def test_gate_fails_the_slowed_run_with_a_one_line_reason(runs: dict[str, Path]) -> None:
    done = cli("gate", str(runs["A"]), str(runs["B"]), "--fail-on", "fwd_latency:+10%")
    assert (done.returncode, done.stderr) == (1, "")
    assert len(done.stdout.splitlines()) == 1
    assert done.stdout.startswith("FAIL: fwd_latency got worse: ")
    assert "beyond fwd_latency:+10% and above the base run's range over its clean steps (A " in done.stdout
    both = cli(
        "gate", str(runs["A"]), str(runs["B"]), "--fail-on", "fwd_latency:+10%", "--fail-on", "mfu:-5%"
    )
    assert both.returncode == 1 and "; mfu got worse: " in both.stdout


def test_gate_passes_a_run_of_the_same_configuration(runs: dict[str, Path]) -> None:
    done = cli("gate", str(runs["A"]), str(runs["A2"]), "--fail-on", "fwd_latency:+10%")
    assert (done.returncode, done.stderr) == (0, ""), done.stdout
    assert done.stdout.startswith("ok: fwd_latency: ") and len(done.stdout.splitlines()) == 1


def test_gate_json_says_each_check(runs: dict[str, Path]) -> None:
    done = cli("gate", str(runs["A"]), str(runs["B"]), "--fail-on", "fwd_latency:+10%", "--json")
    data = json.loads(done.stdout)
    assert (done.returncode, data["passed"], data["exit_code"]) == (1, False, 1)
    (check,) = data["checks"]
    assert (check["rule"], check["limit"], check["failed"], check["noise"]) == (
        "fwd_latency:+10%",
        0.1,
        True,
        False,
    )
    assert check["new"]["low"] > check["base"]["high"]  # every step of B slower than every step of A
    assert check["relative"] > 0.1


def test_every_rate_over_the_iter_has_the_iter_steps_range_as_a_rate(runs: dict[str, Path]) -> None:
    """The model's and the hardware's FLOPS, MFU, HFU and samples/s: one step range, the
    iter's, so each is as far from its ends as the others (a rate without one would gate on any step's
    noise)."""
    found = figures(load(runs["A"]))
    rates = ["flops_per_sec", "hardware_flops_per_sec", "mfu", "hfu", "samples_per_sec"]
    spans = {n: (found[n].low / found[n].value, found[n].high / found[n].value) for n in rates}
    low, high = spans["flops_per_sec"]
    assert low < 1 < high
    assert all(s == pytest.approx((low, high), rel=1e-9) for s in spans.values()), spans


def copy_runs(folder: Path, *profiles: Path) -> Path:
    """``folder`` holding each profile as a run of its own (``run{i}/``, as a logger's versions lay
    them out), each beside a trace file of the same stem that ``gate`` must pass over."""
    for i, profile in enumerate(profiles):
        run_dir = folder / f"run{i}"
        run_dir.mkdir(parents=True)
        (run_dir / profile.name).write_text(profile.read_text())
        (run_dir / profile.with_suffix(".trace.json").name).write_text("[]")
    return folder


def test_gate_reads_a_folder_as_several_runs_their_median_within_their_range(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    base = copy_runs(tmp_path / "base", runs["A"], runs["A2"])
    fwd = [json.loads(runs[r].read_text())["metrics"]["flops_profiler/fwd_latency"] for r in ("A", "A2", "B")]
    done = cli("gate", str(base), str(runs["B"]), "--fail-on", "fwd_latency:+10%", "--json")
    data = json.loads(done.stdout)
    assert (done.returncode, data["exit_code"], data["base"], data["new"]) == (
        1,
        1,
        str(base),
        str(runs["B"]),
    )
    assert data["base_runs"] == [str(base / f"run{i}" / runs["A"].name) for i in (0, 1)]
    (check,) = data["checks"]
    # the median of two runs is their mean; their range, the two values
    assert check["base"] == {
        "value": (fwd[0] + fwd[1]) / 2,
        "low": min(fwd[:2]),
        "high": max(fwd[:2]),
        "runs": 2,
    }
    assert check["new"]["value"] == fwd[2] and check["new"]["runs"] == 1
    line = cli("gate", str(base), str(runs["B"]), "--fail-on", "fwd_latency:+10%").stdout
    assert line.startswith("FAIL: fwd_latency got worse: ")
    assert "beyond fwd_latency:+10% and above the base's range over its 2 runs (A " in line
    # the same runs on both sides, in another order: the same median, a pass
    new = copy_runs(tmp_path / "new", runs["A2"], runs["A"])
    done = cli("gate", str(base), str(new), "--fail-on", "fwd_latency:+10%")
    assert (done.returncode, done.stderr) == (0, "") and done.stdout.startswith("ok: fwd_latency: ")
    assert "(+0.0%), within fwd_latency:+10%" in done.stdout


def test_gate_exits_2_on_a_folder_of_runs_that_did_other_work_or_of_none(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    mixed = copy_runs(tmp_path / "mixed", runs["A"], runs["C"])
    done = cli("gate", str(mixed), str(runs["A"]), "--fail-on", "fwd_latency:+10%")
    other = mixed / "run1" / runs["C"].name
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(
        f"flops-callbacks gate: error: {other} is not a run of {mixed / 'run0' / runs['A'].name}'s "
        "configuration: the runs did different work: "
    ), done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = cli("gate", str(runs["A"]), str(empty), "--fail-on", "fwd_latency:+10%")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(
        f"flops-callbacks gate: error: {empty}: a folder with no flops_profile_step"
    )
    done = cli("diff", str(empty), str(runs["A"]))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(
        f"flops-callbacks diff: error: {empty}: a folder: diff compares two profile"
    )


def test_gate_exits_2_on_a_file_that_is_not_a_profile_and_names_it(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    broken, foreign = tmp_path / "broken.json", tmp_path / "foreign.json"
    broken.write_text(runs["A"].read_text()[:500])
    foreign.write_text(json.dumps({"eval_loss": 0.4}))
    a = str(runs["A"])
    cases = {
        (a, str(broken), "fwd_latency:+10%"): f"{broken}: not a profile: not valid JSON",
        (a, str(foreign), "fwd_latency:+10%"): f'{foreign}: not a flops_callbacks profile (no "schema"',
        (
            str(tmp_path / "missing.json"),
            a,
            "fwd_latency:+10%",
        ): f"{tmp_path / 'missing.json'}: cannot be read (No such file or directory)",
    }
    for (base, new, rule), message in cases.items():
        done = cli("gate", base, new, "--fail-on", rule)
        assert (done.returncode, done.stdout) == (2, ""), (rule, done.stdout)
        assert done.stderr.startswith(f"flops-callbacks gate: error: {message}"), done.stderr


def test_gate_exits_2_on_an_unknown_figure_or_a_bad_rule_and_names_it(
    runs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    a = str(runs["A"])
    cases = {
        "fwd_lat:+10%": f"--fail-on fwd_lat:+10%: {a} has no figure 'fwd_lat' (it has: fwd_flops, bwd_flops,",
        "tokens_per_sec:-5%": f"--fail-on tokens_per_sec:-5%: {a} has no figure 'tokens_per_sec' (it has: ",
        "fwd_latency:10%": "--fail-on 'fwd_latency:10%': expected FIGURE:+N%",
        "fwd_latency:+ten%": "--fail-on 'fwd_latency:+ten%': expected FIGURE:+N%",
        "fwd_latency+10%": "--fail-on 'fwd_latency+10%': expected FIGURE:+N%",
        # a rule that would fail on an improvement (it said "samples_per_sec got worse" of a 43% rise)
        "samples_per_sec:+10%": (
            "--fail-on samples_per_sec:+10%: samples_per_sec is better higher, so the rule would fail on an "
            "improvement; a gate fails on it getting worse: samples_per_sec:-10%"
        ),
        "fwd_latency:-2.5%": "--fail-on fwd_latency:-2.5%: fwd_latency is better lower, so the rule would "
        "fail on an improvement; a gate fails on it getting worse: fwd_latency:+2.5%",
    }
    for rule, message in cases.items():
        assert main(["gate", a, a, "--fail-on", rule]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"flops-callbacks gate: error: {message}"), err
    # the prefix may be given: any metric of the dict, by its logged name too
    assert main(["gate", a, a, "--fail-on", "flops_profiler/samples_per_sec:-5%"]) == 0
    assert capsys.readouterr().out.startswith("ok: samples_per_sec: ")


def test_a_figure_one_run_lacks_is_said_by_diff_and_gate_with_the_reason_its_file_gives(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A (given a peak: MFU and HFU) against the same run without one, as on a CPU: ``diff`` lists the two
    figures B lacks and why, and ``gate --fail-on mfu:-5%`` names B's reason, not only B's figures."""
    data = json.loads(runs["A"].read_text())
    assert "flops_profiler/mfu" in data["metrics"] and "flops_profiler/hfu" in data["metrics"]
    why = "no peak FLOPS for a cpu device: pass peak_flops=... (or 'measure')"
    data["metrics"] = {
        k: v for k, v in data["metrics"].items() if k not in ("flops_profiler/mfu", "flops_profiler/hfu")
    }
    data["peak"] = {"none": why}
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    done = cli("diff", str(runs["A"]), str(bare))
    assert done.returncode == 0
    assert f"only in A: mfu, hfu (B has none: {why})" in done.stdout.splitlines()
    listed = json.loads(cli("diff", str(bare), str(runs["A"]), "--json").stdout)["one_sided"]
    assert listed == [{"name": n, "in": "B", "why_not_the_other": why} for n in ("mfu", "hfu")]
    assert main(["gate", str(runs["A"]), str(bare), "--fail-on", "mfu:-5%"]) == 2
    err = capsys.readouterr().err
    assert f"--fail-on mfu:-5%: {bare} has no figure 'mfu': {why} (it has: " in err


def test_bad_options_and_unwritable_pages_exit_2_naming_the_option(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    a, blocker, binary = str(runs["A"]), tmp_path / "a-file", tmp_path / "binary.json"
    blocker.write_text("")
    binary.write_bytes(b"\xff\xfe{}")
    page = blocker / "a.html"  # under a file: no folder can be made there
    cases = {
        (
            "show",
            a,
            "--module-depth",
            "-5",
        ): "show: error: argument --module-depth: expected an int >= -1, got '-5'",
        (
            "show",
            a,
            "--top-modules",
            "0",
        ): "show: error: argument --top-modules: expected an int >= 1, got '0'",
        ("diff", a, a, "--top", "-1"): "diff: error: argument --top: expected an int >= 0, got '-1'",
        ("show", a, "--html", str(page)): f"show: error: --html {page}: cannot be written (",
        ("show", str(binary)): f"show: error: {binary}: not a profile: not UTF-8 text (invalid start byte)",
        ("show", str(tmp_path)): f"show: error: {tmp_path}: a folder, not a profile file (flops_profile_step",
    }
    for args, message in cases.items():
        done = cli(*args)
        assert done.returncode == 2 and (done.stdout == "" or "--html" in args), args  # the report came first
        assert f"flops-callbacks {message}" in done.stderr, done.stderr


def test_a_reader_that_stops_early_changes_no_exit_code(runs: dict[str, Path]) -> None:
    """``| head``: the pipe closed before the command writes is no error; the gate's verdict stands."""
    for args, code in (
        (("show", str(runs["A"])), 0),
        (("gate", str(runs["A"]), str(runs["B"]), "--fail-on", "fwd_latency:+10%"), 1),
    ):
        command = [sys.executable, "-m", "flops_callbacks", *args]
        for buffered in (True, False):  # the pipe found closed at a write, or at the last flush
            env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | {"PYTHONPATH": str(ROOT)}
            if not buffered:
                env["PYTHONUNBUFFERED"] = "1"
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            process.stdout.close()  # before the command has imported anything: no reader for its output
            try:
                err = process.stderr.read().decode()
                process.wait(timeout=120)
            finally:
                if process.poll() is None:
                    process.kill()
            assert (process.returncode, err) == (code, ""), (args, buffered, err)


def test_the_console_script_runs_main_and_imports_no_framework(runs: dict[str, Path]) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+)
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)\n\n", pyproject, re.M | re.S)[1]
    entry = "flops_callbacks.cli:main"
    assert scripts == f'flops-callbacks = "{entry}"'
    done = run("gate", str(runs["A"]), str(runs["B"]), "--fail-on", "fwd_latency:+10%", entry=entry)
    assert done.returncode == 1 and done.stdout.startswith("FAIL: fwd_latency got worse")
    check = (
        "import sys; from flops_callbacks.cli import main; code = main(sys.argv[1:]); "
        "frameworks = ('lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'deepspeed'); "
        "print(sorted(m for m in frameworks if m in sys.modules))"
    )
    done = in_group([sys.executable, "-c", check, "diff", str(runs["A"]), str(runs["B"])], timeout=120)
    assert "Modules by the change of their own time" in done.stdout
    assert done.stdout.splitlines()[-1] == "[]"


def test_colours_only_when_asked_or_on_a_terminal(
    runs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    assert main(["diff", str(runs["A"]), str(runs["B"]), "--color", "always"]) == 0
    out = capsys.readouterr().out
    assert "\033[31mworse\033[0m" in out  # fwd_latency, in red
    assert main(["diff", str(runs["A"]), str(runs["B"])]) == 0  # captured: not a terminal
    assert ANSI not in capsys.readouterr().out


def own_fwd(modules: dict[str, dict]) -> dict[str, float]:
    """Each module's forward latency less its children's, from the JSON's module entries by name."""

    def children(name: str) -> list[str]:
        return [n for n in modules if n and n.rpartition(".")[0] == name]

    return {
        n: max(m["fwd_latency"] - sum(modules[c]["fwd_latency"] for c in children(n)), 0.0)
        for n, m in modules.items()
    }


def test_diff_picture_draws_b_with_a_own_times_to_colour_by(runs: dict[str, Path], tmp_path: Path) -> None:
    page = tmp_path / "diff.html"
    assert main(["diff", str(runs["A"]), str(runs["B"]), "--html", str(page), "--json"]) == 0
    html = page.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="profile-data">(.*?)</script>', html)[1])
    a, b = (json.loads(runs[n].read_text())["profile"]["modules"] for n in ("A", "B"))
    assert [m["name"] for m in data["modules"]][:1] == [""] and {m["name"] for m in data["modules"]} == set(b)
    assert data["against"]["label"] == "A" and data["against"]["note"] == ""
    base = data["against"]["modules"]
    assert set(base) == set(a) and set(base["slow"]) == {"fwd", "bwd", "own_fwd", "own_bwd"}
    own_a, own_b = own_fwd(a), own_fwd(b)
    for name, m in a.items():
        assert (base[name]["fwd"], base[name]["bwd"]) == (m["fwd_latency"], m["bwd_latency"])
        assert base[name]["own_fwd"] == pytest.approx(own_a[name], abs=1e-12)
    # the module whose own time changed most, the one the page paints in the full red
    changes = {name: own_b[name] - own_a[name] for name in a}
    assert max(changes, key=lambda n: abs(changes[n])) == "slow"
    assert 0.66 * SLOWER <= changes["slow"] <= 2 * SLOWER


def test_show_and_diff_say_the_slow_rank_of_a_several_rank_file(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A's file as a 2-rank run would write it: rank 1 asleep 20 ms in its forward (A), then no rank
    standing out (B); read back, ``show`` prints the slow rank's rows, ``diff`` both verdicts and figures."""
    base = load(runs["A"]).result
    paths = []
    for name, ranks in (("a", forward_sleep()), ("b", [forward_sleep()[0]] * 2)):
        result = dataclasses.replace(base, slow_rank=find_slow_rank(ranks))
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(json_data(result)))
    out = io.StringIO()
    assert main(["show", str(paths[0])], out) == 0
    shown = out.getvalue()
    verdict = "1 of 2, fwd +20 ms over the median; the others wait 20 ms a step in all_reduce"
    assert "rank 1 of 2: fwd +20 ms a step over the other ranks' median (beyond the noise: 620 us)" in shown
    assert "  rank 1 (slow): " in shown
    out = io.StringIO()
    assert main(["diff", str(paths[0]), str(paths[1])], out) == 0
    lines = out.getvalue().splitlines()
    assert lines[3:5] == [
        f"slow rank, A: {verdict}",
        "slow rank, B: none stands out (the ranks agree within their step-to-step noise)",
    ]
    rows = {re.split(r" {2,}", line)[0]: re.split(r" {2,}", line) for line in lines}
    assert rows["slow_rank"][1:4] == ["rank 1", "none", "changed"]  # a rank's number is no quantity
    assert rows["slow_rank_extra_latency"][1:3] == ["20 ms", "0 s"]
    out = io.StringIO()
    assert main(["diff", "--json", str(paths[0]), str(paths[1])], out) == 0
    figure = next(f for f in json.loads(out.getvalue())["figures"] if f["name"] == "slow_rank")
    assert figure["relative"] is None and figure["direction"] is None
    capsys.readouterr()
    assert main(["gate", str(paths[1]), str(paths[0]), "--fail-on", "slow_rank:+50%"]) == 2
    assert "slow_rank names a rank, not a quantity: gate how long the others wait" in capsys.readouterr().err


def page_data(page: Path) -> dict:
    """The data a picture's page draws (its modules, and the run it is compared against)."""
    found = re.search(r'<script type="application/json" id="profile-data">(.*?)</script>', page.read_text())
    return json.loads(found[1])


def test_diff_picture_of_a_window_that_timed_no_module_colours_no_change_and_says_why(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A re-profile window (its first step 50, after the counting step 1 of the window it reuses) holds
    that window's module tree: the picture colours no module by a change (none is measured, so none is
    "the same"), and says so above the chart, as the text diff does."""

    def reprofiled(data: dict) -> None:
        data["steps"]["first"] = 50

    window = rewritten(runs["A2"], tmp_path, reprofiled).source
    note = "timed no module (a re-profile window: its module tree is the window's of step 1, reused)"
    for a, b, label in ((str(runs["A"]), window, "B"), (window, str(runs["A"]), "A")):
        page, said = tmp_path / f"{label}.html", f"{label} {note}: no module's change is shown."
        done = cli("diff", a, b, "--html", str(page))
        assert done.returncode == 0 and f"NOTE: {said}" in done.stdout.splitlines()
        assert page_data(page)["against"] is None  # B's modules drawn by their achieved FLOPS
        assert f"<li>{said}</li>" in html.unescape(page.read_text())  # above the chart


def test_diff_of_a_run_whose_module_timing_steps_ran_other_shapes_shows_no_module_change(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A run whose module-timing steps had other batch shapes than its counting step has no module times
    (0 s each: two batches' would mix): diff listed every module falling to 0 s as noise. Now a NOTE says
    why, no module is listed, and ``--json`` says its module times were not measured."""

    def other_shapes(data: dict) -> None:
        data["steps"]["module_shapes_match"] = False
        for module in data["profile"]["modules"].values():
            module.update(fwd_latency=0.0, bwd_latency=0.0, recompute_latency=0.0)

    b = rewritten(runs["A2"], tmp_path, other_shapes).source
    done = cli("diff", str(runs["A"]), b)
    said = (
        "NOTE: B timed no module (its module-timing steps ran other batch shapes than its counting step): "
        "no module's change is shown."
    )
    assert done.returncode == 0 and said in done.stdout.splitlines()
    assert "(left out: a run's module times are not its window's own, NOTE above)" in done.stdout
    data = json.loads(cli("diff", str(runs["A"]), b, "--json").stdout)
    assert data["modules"] == [] and data["module_times_measured"] == {"a": True, "b": False}


def cut_short(data: dict) -> None:
    """The run as one that ended before its clean steps leaves it: no clean step, its latencies the one
    step timed instead (a module-timing step's)."""
    data["steps"]["clean"] = []
    data["clean_each"] = data["clean_each"][:1]
    data["metrics"]["flops_profiler/clean_steps"] = 0.0


def test_a_run_with_no_clean_step_is_noted_by_diff_and_refused_by_a_gate_on_its_times(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    a, cut = str(runs["A"]), rewritten(runs["A2"], tmp_path, cut_short).source
    done = cli("diff", a, cut)
    assert done.returncode == 0
    assert (
        "NOTE: B's latencies rest on no clean step (clean_steps 0: the run ended before them): they are its "
        "counting or module-timing step's, inflated by the profiler's own work, so its times and rates are "
        "not its configuration's."
    ) in done.stdout.splitlines()
    assert json.loads(cli("diff", a, cut, "--json").stdout)["clean_steps"] == {"a": 6, "b": 0}
    for rule in ("iter_latency:+10%", "samples_per_sec:-5%", "mfu:-5%"):
        done = cli("gate", a, cut, "--fail-on", rule)
        figure = rule.partition(":")[0]
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == (
            f"flops-callbacks gate: error: --fail-on {rule}: {cut} has no clean step (clean_steps 0: the run "
            f"ended before them), so its {figure} is its counting or module-timing step's, inflated by the "
            "profiler's own work, not the configuration's: gate a run long enough for its clean steps, or a "
            "count (bwd_bytes, bwd_flops, clean_steps, fwd_bytes, fwd_flops, fwd_macs, padding_fraction, "
            "params, recompute_flops, saved_activation_bytes)\n"
        )
    # counts are no clock's: gated as any run's, and exact (A's forward 19712 flops, then 1000 more)
    done = cli("gate", cut, a, "--fail-on", "fwd_flops:+0%")
    assert (done.returncode, done.stdout) == (
        0,
        "ok: fwd_flops: 19.71 K -> 19.71 K (+0.0%), within fwd_flops:+0%\n",
    )

    def grown(data: dict) -> None:
        data["metrics"]["flops_profiler/fwd_flops"] += 1000
        data["profile"]["modules"][""]["fwd_flops"] += 1000

    done = cli("gate", cut, rewritten(runs["A"], tmp_path, grown).source, "--fail-on", "fwd_flops:+0%")
    assert done.returncode == 1
    assert done.stdout == (  # 1000 / 19712 = +5.07%
        "FAIL: fwd_flops got worse: 19.71 K -> 20.71 K (+5.1%), beyond fwd_flops:+0% (a count: exact, no "
        "range)\n"
    )


def test_diff_and_gate_name_each_difference_of_setup(runs: dict[str, Path], tmp_path: Path) -> None:
    """A against A2 as a 2-rank bf16 run on CUDA would leave it, with twice A's peak: each difference named,
    A's -> B's, and what it does to the figures where that is not plain; the gate's exit code as before."""

    def elsewhere(data: dict) -> None:
        data["parallel"].update(world_size=2, data_parallel=2)
        data["profile"]["device"] = "cuda:0"
        data["compute_dtype"] = "bf16"
        data["peak"]["flops"] = 2e11

    a, b = str(runs["A"]), rewritten(runs["A2"], tmp_path, elsewhere).source
    note = (
        "the runs ran on different setups: world size 1 -> 2; data-parallel size 1 -> 2 (samples and tokens "
        "per second count every replica); device type cpu -> cuda; compute dtype fp32 -> bf16; peak FLOPS "
        "100 GFLOPS -> 200 GFLOPS (MFU and HFU are over each run's own)"
    )
    done = cli("diff", a, b)
    assert done.returncode == 0 and f"NOTE: {note}." in done.stdout.splitlines()
    assert json.loads(cli("diff", a, b, "--json").stdout)["setup_note"] == note
    assert "NOTE: the runs ran on" not in cli("diff", a, str(runs["A2"])).stdout
    done = cli("gate", a, b, "--fail-on", "fwd_flops:+0%")
    assert (done.returncode, done.stderr) == (0, f"flops-callbacks gate: note: {note}\n")
    assert json.loads(cli("gate", a, b, "--fail-on", "fwd_flops:+0%", "--json").stdout)["setup_note"] == note

    # a peak given 5% apart is named too (MFU moves by the peaks' ratio, not by the run's speed); measured
    # by each run, the note says so
    def given(data: dict) -> None:
        data["peak"]["flops"] = 1.05e11

    def measured(data: dict) -> None:
        data["peak"]["source"] = "measured: fp32 dense matmul 512x512 on cpu, best of 5 in 0.4 s"

    named = "the runs ran on different setups: peak FLOPS 100 GFLOPS -> 105 GFLOPS"
    again = rewritten(runs["A2"], tmp_path, given).source
    assert (
        f"NOTE: {named} (MFU and HFU are over each run's own)." in cli("diff", a, again).stdout.splitlines()
    )
    a_measured = rewritten(runs["A"], tmp_path, measured).source
    b_measured = rewritten(runs["A2"], tmp_path, lambda d: (given(d), measured(d))).source
    done = cli("gate", a_measured, b_measured, "--fail-on", "fwd_flops:+0%")
    note = f"{named} (each run measured its own: MFU and HFU are over each run's own)"
    assert (done.returncode, done.stderr) == (0, f"flops-callbacks gate: note: {note}\n")


def test_diff_names_runs_whose_model_flops_left_the_padding_apart_and_not(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The same padded batches, one run telling the model's work on real tokens apart, the other not (its
    model flops are the flops as run): their flops_per_sec and MFU differ by the padding, unnamed."""

    def padded(why: str) -> Callable[[dict], None]:
        def lay_out(data: dict) -> None:
            layout = {"rows": 4, "sequences": 4, "real_tokens": 100, "positions": 128, "not_apart": why}
            data["batch_layout"] = layout

        return lay_out

    a = rewritten(runs["A"], tmp_path, padded("")).source
    b = rewritten(runs["A2"], tmp_path, padded("a compiled model")).source
    note = (
        "the runs ran on different setups: model flops padding apart -> as run (padding in) (flops_per_sec "
        "and MFU count different work: hardware_flops_per_sec compares)"
    )
    assert f"NOTE: {note}." in cli("diff", a, b).stdout.splitlines()
    assert (
        "NOTE: the runs ran on"
        not in cli("diff", a, rewritten(runs["A2"], tmp_path, padded("")).source).stdout
    )


def test_show_diff_and_gate_exit_2_on_a_hand_damaged_file_naming_the_field(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    cases = {
        '"steps": "clean" is null, expected a list of step numbers': lambda d: d["steps"].update(clean=None),
        '"clean_each" is [], expected a list of each clean step\'s work and seconds (at least the one step a '
        "window with no clean step timed instead)": lambda d: d.update(clean_each=[]),
        # a value of the wrong type or no number: named here, not a TypeError in the comparison (exit 1, as
        # a regression) or a NaN that every rule passes
        'a clean step\'s "seconds": "fwd" is null, expected a number': lambda d: d["clean_each"][0][
            "seconds"
        ].update(fwd=None),
        'a clean step\'s "seconds": "bwd" is "0.01", expected a number': lambda d: d["clean_each"][-1][
            "seconds"
        ].update(bwd="0.01"),
        'a module\'s "fwd_latency" is "x", expected a number': lambda d: d["profile"]["modules"][""].update(
            fwd_latency="x"
        ),
        'a module\'s "fwd_flops" is Infinity, expected a number': lambda d: d["profile"]["modules"][
            ""
        ].update(fwd_flops=float("inf")),
        '"metrics": "flops_profiler/fwd_latency" is nan, expected a finite number': lambda d: d[
            "metrics"
        ].update({"flops_profiler/fwd_latency": float("nan")}),
        # any field of a type other than the one it holds (a TypeError, a KeyError, an AttributeError in
        # the renderers: a traceback and exit 1, as a failed gate)
        "clean.steps[0].work.counts.bwd_flops is null, expected an integer": lambda d: d["clean_each"][0][
            "work"
        ]["counts"].update(bwd_flops=None),
        "peak.flops is null, expected a number": lambda d: d["peak"].update(flops=None),
        "profile.device is null, expected a string": lambda d: d["profile"].update(device=None),
        '"profile": "modules" has no "" key (the model\'s own row)': lambda d: d["profile"]["modules"].pop(
            ""
        ),
    }
    for i, (why, damage) in enumerate(cases.items()):
        data, damaged = json.loads(runs["A"].read_text()), tmp_path / f"damaged{i}.json"
        damage(data)
        damaged.write_text(json.dumps(data))
        gate = ("gate", str(runs["A"]), str(damaged), "--fail-on", "iter_latency:+10%")
        for args in (("show", str(damaged)), ("diff", str(runs["A"]), str(damaged)), gate):
            done = cli(*args)
            assert (done.returncode, done.stdout) == (2, ""), args
            assert done.stderr == (
                f"flops-callbacks {args[0]}: error: {damaged}: a profile of schema version 2, but malformed: "
                f"{why}\n"
            )
