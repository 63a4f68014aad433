"""The docs' recipes run as written on a CPU: the gate recipe of ``docs/comparing-runs.md`` (runs of the
demo, base and new in turns, then ``flops-callbacks gate`` on the two folders; here in two turns, not
the recipe's ten: twenty runs of the demo would hold CI eight minutes, and ``benchmarks/gate_noise.py``
runs ten) gives a verdict over every run, and its gate exits 1 on a run of the demo made slower (its
forward waits a whole median step more; ``benchmarks/gate_noise.py`` measures how often two sides of one
configuration pass, and a side 20% slower fails); the demo's MFU on a CPU is against a measured peak,
said as measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.test_benchmarks import benchmark

ROOT = Path(__file__).resolve().parents[1]
PROFILE = Path("gpt") / "version_0" / "flops_profile_step10.json"
TURNS = 1  # the recipe's loop, cut from its ten turns (a gate over several runs a side: tests/test_cli.py)


def recipe(page: str, heading: str) -> str:
    """The first ``bash`` block under ``heading`` of a docs page."""
    text = (ROOT / "docs" / page).read_text()
    section = text[text.index(heading) :]
    found = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert found is not None, (page, heading)
    return found[1]


def shell(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """``script`` in bash, from ``cwd`` (made, with the repository's ``examples/`` in it), with this
    Python as ``python`` and this checkout's command line as ``flops-callbacks`` first on the PATH (what
    the console script runs, ``tests/test_cli.py`` checks; an installed one may be another checkout's)."""
    cwd.mkdir(parents=True)
    (cwd / "examples").symlink_to(ROOT / "examples")
    bin_dir = cwd / "bin"
    bin_dir.mkdir()
    for name, runs in (("python", ""), ("flops-callbacks", " -m flops_callbacks")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{runs} "$@"\n')
        (bin_dir / name).chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        ["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_gate_recipe_runs_as_written_and_fails_a_run_made_slower(tmp_path: Path) -> None:
    """Real runs on a machine others may share. Whether two sides of one configuration pass the gate is a
    matter of the machine's noise, measured by ``benchmarks/gate_noise.py``, not here: the recipe must
    run as written (in fewer turns) and the gate give a verdict (0 or 1, never 2, an error) over every
    run of each side; a run slowed by a whole median step more must fail it."""
    script = recipe("comparing-runs.md", "## A gate in CI")
    assert "python examples/lightning/train.py" in script and "flops-callbacks gate" in script
    gate_noise = benchmark("gate_noise")  # it measures the recipe's runs and rules
    loop = re.search(r"^for turn in ([\d ]+); do", script, re.MULTILINE)
    assert loop is not None and len(loop[1].split()) == gate_noise.TURNS
    script = script.replace(loop[0], f"for turn in {' '.join(map(str, range(1, TURNS + 1)))}; do")
    runs = tmp_path / "recipe"
    done = shell(script, runs)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    verdict = done.stdout.splitlines()[-1]
    expected = "ok: iter_latency: " if done.returncode == 0 else "FAIL: iter_latency got worse: "
    assert verdict.startswith(expected), verdict
    # the gate read each side's folder as its runs: one per turn of the loop
    gate_line = next(line for line in script.splitlines() if line.startswith("flops-callbacks gate "))
    command = [sys.executable, "-m", "flops_callbacks", *gate_line.split()[1:], "--json"]
    checked = subprocess.run(
        command, cwd=runs, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    data = json.loads(checked.stdout)
    assert (checked.returncode, len(data["base_runs"]), len(data["new_runs"])) == (
        done.returncode,
        TURNS,
        TURNS,
    )
    assert {check["base"]["runs"] for check in data["checks"]} == {TURNS}
    # the demo on a CPU: MFU against the measured peak, said so beside it in the report
    base = json.loads((runs / "base" / PROFILE).read_text())
    assert base["peak"]["source"].startswith("measured: fp32 dense matmul ")
    assert base["metrics"]["flops_profiler/mfu"] > 0
    assert re.search(r"^MFU / HFU +MFU \d+\.\d\d%, HFU \d+\.\d\d% of .* measured$", done.stdout, re.MULTILINE)
    report = (runs / "base" / PROFILE).with_suffix(".txt").read_text()
    assert re.search(r"peak FLOPS per device \(measured: fp32 dense matmul .*\n.*MFU = ", report)
    # the same gate, the base's folder against a run whose forward waits the base's median step more
    run = next(line.strip() for line in script.splitlines() if "python examples/lightning/train.py" in line)
    arguments = run.split()[2:]
    arguments = arguments[: arguments.index("--default-root-dir")]
    steps = ["--max-steps", str(gate_noise.MAX_STEPS), "--clean-steps", str(gate_noise.CLEAN_STEPS)]
    assert arguments == steps
    rules = [part for rule in re.findall(r"--fail-on (\S+)", script) for part in ("--fail-on", rule)]
    assert rules == gate_noise.RULES
    wait = base["spread"]["iter"]["median"]  # twice as slow: beyond any drift seen between two runs
    for attempt in range(2):
        slower = gate_noise.run_demo(runs / f"slower{attempt}", arguments, threads=1, sleep=wait)
        code, line = gate_noise.gate(runs / "base", slower, rules)
        if code == 1:
            break
    assert code == 1 and line.startswith("FAIL: iter_latency got worse: "), line
    one, several = "the base run's range over its clean steps", f"the base's range over its {TURNS} runs"
    assert f"above {one if TURNS == 1 else several}" in line, line
