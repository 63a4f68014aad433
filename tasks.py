"""Set up ``.venv`` and run a job, with nothing but Python 3.10+: ``python3 tasks.py demo|test|bench``.

demo   the main job: the Lightning example on CPU (profile at step 10, TensorBoard logs)
test   ruff + the test suite (what CI runs)
bench  the overhead benchmarks
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
# torch==2.13.0 resolves to a CPU build on our machines; set FLOPS_CALLBACKS_TORCH for another build.
TORCH = os.environ.get("FLOPS_CALLBACKS_TORCH", "torch==2.13.0")

JOBS = {
    "demo": [["examples/lightning/train.py"]],
    "test": [["-m", "ruff", "check", "."], ["-m", "pytest", "-q"]],
    "bench": [
        ["benchmarks/overhead.py"],
        ["benchmarks/lightning_overhead.py"],
        ["benchmarks/hf_overhead.py"],
        ["benchmarks/throughput_overhead.py"],
    ],
}


def venv_python() -> Path:
    return VENV / ("Scripts" if os.name == "nt" else "bin") / "python"


def run(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, cwd=ROOT, check=True)


def setup() -> None:
    """Create .venv and install the package with every extra (once, again when pyproject changes)."""
    stamp = VENV / ".installed"
    if stamp.exists() and stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime:
        return
    if not venv_python().exists():
        venv.create(VENV, with_pip=True)
    pip = (str(venv_python()), "-m", "pip", "install", "-q")
    run(*pip, "--upgrade", "pip")
    run(*pip, TORCH)
    run(*pip, "-e", ".[dev]", TORCH)
    stamp.touch()


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in JOBS:
        print(__doc__)
        return 2
    setup()
    for job in JOBS[argv[0]]:
        run(str(venv_python()), *job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
