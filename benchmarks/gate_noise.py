"""Whether ``flops-callbacks gate`` with the docs' rules passes two runs of one configuration and fails a
run made slower: a CI gate must fail on regressions, not on noise.

Goal: of PAIRS pairs of runs of one configuration, every pair passes (exit 0), and every run made 20%
slower fails (exit 1).

Method: the demo (``examples/lightning/train.py``: a small GPT on CPU, batch 8 of 128 tokens, profile at
step 10, peak measured) run as the docs' gate recipe runs it, PAIRS times three runs in a row, each in a
process of its own: A, A again (A2), and A made slower (S): the same model with a busy wait at the
start of its forward of SLOWER x A's median iter latency (read from A's JSON), so that S's step takes
20% longer for the same flops (a wait on the clock, not a sleep: a sleeping process lets the CPU's
threads go cold, and the step grows by more than the sleep). Then ``gate A A2 RULES`` (expected 0) and
``gate A S RULES`` (expected 1), RULES being the docs' (``docs/comparing-runs.md``). Printed: per pair
each run's median iter latency, A's range over its clean steps, the two exit codes, and the machine's
load (1-minute load average) as each run ended; then the tally.
The runs share the machine with whatever else runs on it, as a CI runner does; each runs on THREADS
torch threads (``OMP_NUM_THREADS``, as the recipe sets it: on a machine whose cores are shared, a second
thread waits at every matmul's barrier for a core a neighbour holds, and the steps spread tenfold: on the
2-core CPU at a load average of 4 the demo's median step reads 1.17 s on two threads, 54 ms on one, 39 ms
with the machine to itself).

    python benchmarks/gate_noise.py                         # 10 pairs, the docs' recipe (20 clean steps)
    python benchmarks/gate_noise.py --clean-steps 5 --max-steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from flops_callbacks.reporting.compare import spread_range  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "lightning" / "train.py"
RULES = ["--fail-on", "iter_latency:+10%", "--fail-on", "fwd_flops:+0%"]  # docs/comparing-runs.md's
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


def iter_spread(path: Path) -> dict[str, float]:
    """The run's median iter latency, the range the gate reads over its clean steps (their fastest and
    slowest tenth left out), seconds, and their count."""
    data = json.loads(path.read_text())
    each = [sum(step["seconds"][p] for p in ("fwd", "bwd", "step")) for step in data["clean_each"]]
    low, high = spread_range(each)
    return {"median": data["spread"]["iter"]["median"], "low": low, "high": high, "steps": len(each)}


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--clean-steps", default="20", help="the demo's --clean-steps (the docs' recipe: 20)")
    parser.add_argument("--max-steps", type=int, default=40, help="the demo's --max-steps (the docs': 40)")
    parser.add_argument("--slower", type=float, default=0.2, help="S's extra time, a fraction of A's iter")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (the recipe's: 1)"
    )
    parser.add_argument(
        "--keep", metavar="DIR", help="keep the runs' files in DIR (default: a scratch folder)"
    )
    args = parser.parse_args()
    demo_args = ["--max-steps", str(args.max_steps), "--clean-steps", args.clean_steps]
    same = slowed = 0
    print(
        f"rules: {' '.join(RULES)}; demo: {' '.join(demo_args)}, OMP_NUM_THREADS={args.threads}; "
        f"S: +{args.slower:.0%} of A's iter"
    )
    print("| pair | A iter (range) | A2 iter | gate A A2 | S iter (S / A) | gate A S | load A, A2, S |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.keep or temporary
        for pair in range(1, args.pairs + 1):
            a = run_demo(Path(scratch) / f"{pair}-a", demo_args, args.threads)
            load = [os.getloadavg()[0]]
            a2 = run_demo(Path(scratch) / f"{pair}-a2", demo_args, args.threads)
            load.append(os.getloadavg()[0])
            spread = iter_spread(a)
            wait = args.slower * spread["median"]
            s = run_demo(Path(scratch) / f"{pair}-s", demo_args, args.threads, sleep=wait)
            load.append(os.getloadavg()[0])
            slow = iter_spread(s)["median"]
            code_same, line_same = gate(a, a2, RULES)
            code_slow, line_slow = gate(a, s, RULES)
            same += code_same == 0
            slowed += code_slow == 1
            ms = {k: f"{1e3 * v:.2f}" for k, v in spread.items() if k != "steps"}
            print(
                f"| {pair} | {ms['median']} ms ({ms['low']} .. {ms['high']}, {spread['steps']:.0f} steps) "
                f"| {1e3 * iter_spread(a2)['median']:.2f} ms | {code_same} "
                f"| {1e3 * slow:.2f} ms ({slow / spread['median']:.2f}) | {code_slow} "
                f"| {', '.join(f'{x:.1f}' for x in load)} |",
                flush=True,
            )
            for code, line, expected in ((code_same, line_same, 0), (code_slow, line_slow, 1)):
                if code != expected:
                    print(f"  unexpected exit {code}: {line}", flush=True)
    print(f"same configuration: {same} of {args.pairs} passed; {args.slower:.0%} slower: {slowed} of "
          f"{args.pairs} failed")  # fmt: skip
    return 0 if same == slowed == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
