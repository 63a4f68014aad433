"""Whether ``flops-callbacks gate`` with the docs' rules passes two sides of one configuration and fails
a side made slower: a CI gate must fail on regressions, not on noise.

Goal: of PAIRS pairs of one configuration, every pair passes (exit 0), and every side made 20% slower
fails (exit 1).

Method: the demo (``examples/lightning/train.py``: a small GPT on CPU, batch 8 of 128 tokens, profile at
step 10, peak measured) run as the docs' gate recipe runs it: 40 steps, 20 of them clean. Each pair is
RUNS rounds of three runs in turns, each in a process of its own: A, A again (A2), and A made slower (S):
the same model with a busy wait at the start of its forward of SLOWER x the median iter latency of the
pair's first A (read from its JSON), so that S's step takes 20% longer for the same flops (a wait on the
clock, not a sleep: a sleeping process lets the CPU's threads go cold, and the step grows by more than
the sleep). Each side's runs go into a folder of its own; then ``gate A A2 RULES`` (expected 0) and
``gate A S RULES`` (expected 1), RULES being the docs' (``docs/comparing-runs.md``), with folders (a
side's figure: the median of its runs' medians; its range: what those spread over, from 10 runs on their
fastest and slowest tenth left out) or, with ``--runs 1``, single files (the range: the base run's clean
steps). Printed: per pair each side's median iter latency, A's range, the two exit codes, and the
machine's load (1-minute load average) as the pair ended; then the tally, and how far a run's median
spreads about its pair's (the A and A2 runs).
The runs share the machine with whatever else runs on it, as a CI runner does; each runs on THREADS
torch threads (``OMP_NUM_THREADS``, as the recipe sets it: on a machine whose cores are shared, a second
thread waits at every matmul's barrier for a core a neighbour holds, and the steps spread tenfold: on the
2-core CPU at a load average of 4 the demo's median step reads 1.17 s on two threads, 54 ms on one, 39 ms
with the machine to itself).

    python benchmarks/gate_noise.py                  # 10 pairs of 10 runs a side, the docs' recipe
    python benchmarks/gate_noise.py --runs 1         # 10 pairs of single runs
    python benchmarks/gate_noise.py --max-steps 120 --clean-steps 100   # longer runs
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from flops_callbacks.reporting.compare import Figure, run_figures  # noqa: E402
from flops_callbacks.reporting.profile_file import SavedProfile, load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "lightning" / "train.py"
# docs/comparing-runs.md's recipe: its rules, its turns (runs a side) and the demo's steps
RULES = ["--fail-on", "iter_latency:+10%", "--fail-on", "fwd_flops:+0%"]
TURNS, MAX_STEPS, CLEAN_STEPS = 10, 40, 20
PROFILE = Path("gpt") / "version_0" / "flops_profile_step10.json"  # under the run's --default-root-dir

# The demo, its model's forward slowed by a busy wait of argv[2] seconds; the demo's own arguments follow.
SLOWED = """
import importlib.util, sys, time
path, sleep = sys.argv[1], float(sys.argv[2])
spec = importlib.util.spec_from_file_location("demo", path)
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
forward = demo.GPT.forward
def slowed(self, tokens):
    until = time.perf_counter() + sleep
    while time.perf_counter() < until:
        pass
    return forward(self, tokens)
if sleep > 0:
    demo.GPT.forward = slowed
sys.argv = [path, *sys.argv[3:]]
demo.main()
"""


def run_demo(root: Path, demo_args: list[str], threads: int, sleep: float = 0.0) -> Path:
    """One run of the demo in a process of its own (its forward slowed by ``sleep`` seconds of busy wait);
    its JSON."""
    demo = [str(DEMO), str(sleep), *demo_args, "--default-root-dir", str(root)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        [sys.executable, "-c", SLOWED, *demo], cwd=ROOT, capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"the demo failed:\n{done.stderr[-3000:]}")
    return root / PROFILE


def gate(base: Path, new: Path, rules: list[str]) -> tuple[int, str]:
    """``flops-callbacks gate`` as the docs run it: its exit code and its one line."""
    command = [sys.executable, "-m", "flops_callbacks", "gate", str(base), str(new), *rules]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return done.returncode, (done.stdout or done.stderr).strip()


def side(profiles: list[SavedProfile]) -> Figure:
    """A side's iter latency as the gate reads it (``compare.run_figures``): one run's median within its
    clean steps' range, or the median of several runs' medians within the range of those."""
    return run_figures(profiles)["iter_latency"]


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--runs", type=int, default=TURNS, help="runs a side, in turns (the recipe's)")
    parser.add_argument("--clean-steps", type=int, default=CLEAN_STEPS, help="the demo's (the recipe's)")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="the demo's (the recipe's)")
    parser.add_argument("--slower", type=float, default=0.2, help="S's extra time, a fraction of A's iter")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (the recipe's: 1)"
    )
    parser.add_argument(
        "--keep", metavar="DIR", help="keep the runs' files in DIR (default: a scratch folder)"
    )
    args = parser.parse_args()
    demo_args = ["--max-steps", str(args.max_steps), "--clean-steps", str(args.clean_steps)]
    same = slowed = 0
    spread: list[float] = []  # each A and A2 run's log median, less its pair's mean of them
    print(
        f"rules: {' '.join(RULES)}; demo: {' '.join(demo_args)}, OMP_NUM_THREADS={args.threads}; "
        f"{args.runs} run(s) a side, in turns; S: +{args.slower:.0%} of A's iter"
    )
    print("| pair | A iter (range) | A2 iter | gate A A2 | S iter (S / A) | gate A S | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(args.keep or temporary)
        for pair in range(1, args.pairs + 1):
            found: dict[str, list[Path]] = {"a": [], "a2": [], "s": []}
            profiles: dict[str, list[SavedProfile]] = {name: [] for name in found}
            wait = 0.0
            for i in range(args.runs):
                for name in found:
                    folder = scratch / str(pair) / name / f"run{i}"
                    path = run_demo(folder, demo_args, args.threads, wait if name == "s" else 0.0)
                    found[name].append(path)
                    profiles[name].append(load(path))
                    if name == "a" and i == 0:  # the pair's first A sets S's wait
                        wait = args.slower * side(profiles["a"]).value
            a, a2, s = (side(profiles[name]) for name in ("a", "a2", "s"))
            logs = [math.log(side([run]).value) for run in profiles["a"] + profiles["a2"]]
            spread += [value - statistics.fmean(logs) for value in logs]
            one = args.runs == 1
            base, same_side, slow_side = (
                found[name][0] if one else scratch / str(pair) / name for name in ("a", "a2", "s")
            )
            code_same, line_same = gate(base, same_side, RULES)
            code_slow, line_slow = gate(base, slow_side, RULES)
            same += code_same == 0
            slowed += code_slow == 1
            over = "clean steps" if one else f"{a.runs} runs"
            print(
                f"| {pair} | {1e3 * a.value:.2f} ms ({1e3 * a.low:.2f} .. {1e3 * a.high:.2f}, {over}) "
                f"| {1e3 * a2.value:.2f} ms | {code_same} "
                f"| {1e3 * s.value:.2f} ms ({s.value / a.value:.2f}) | {code_slow} "
                f"| {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
            for code, line, expected in ((code_same, line_same, 0), (code_slow, line_slow, 1)):
                if code != expected:
                    print(f"  unexpected exit {code}: {line}", flush=True)
    print(f"same configuration: {same} of {args.pairs} passed; {args.slower:.0%} slower: {slowed} of "
          f"{args.pairs} failed")  # fmt: skip
    print(f"a run's median iter latency spreads {statistics.pstdev(spread):.1%} (one standard deviation of "
          "the A and A2 runs, each pair about its own mean)")  # fmt: skip
    return 0 if same == slowed == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
