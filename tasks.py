"""Set up ``.venv`` and run a job, with nothing but Python 3.10+: ``python3 tasks.py demo|test|docs|...``.

demo     the main job: the Lightning example on CPU (profile at step 10, TensorBoard logs)
test     ruff, mypy and the test suite (what CI runs)
test-newest  the test suite on the newest torch (torch==2.15.0, PyPI's build) in .venv-newest
docs     write the pages' generated parts (docs/generate.py), then build the site into site/ (mkdocs
         --strict: a broken link or a page not in the nav fails)
console  run the demo and keep its console summary as the README's and the docs' sample
picture  draw docs/profile.png from today's renderer (needs chromium on PATH)
wheel    build the wheel, install it with only torch into a fresh virtualenv, profile a small model
bench    the overhead and timing benchmarks
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
# torch==2.13.0 resolves to a CPU build on our machines; set FLOPS_CALLBACKS_TORCH for another build.
TORCH = os.environ.get("FLOPS_CALLBACKS_TORCH", "torch==2.13.0")
# The newest torch on PyPI, tested beside the pinned one in a virtualenv of its own (PyPI's build is the
# CUDA one: a few GB, it runs the suite on a CPU all the same).
NEWEST_VENV = ROOT / ".venv-newest"
NEWEST_TORCH = "torch==2.15.0"

JOBS = {
    "demo": [["examples/lightning/train.py"]],
    "test": [["-m", "ruff", "check", "."], ["-m", "mypy"], ["-m", "pytest", "-q"]],
    "test-newest": [["-m", "pytest", "-q"]],
    "docs": [["docs/generate.py"], ["-m", "mkdocs", "build", "--strict"]],
    "console": [["docs/console_sample.py"]],
    "picture": [["benchmarks/picture_screenshot.py"]],
    "bench": [
        ["benchmarks/overhead.py"],
        ["benchmarks/lightning_overhead.py"],
        ["benchmarks/hf_overhead.py"],
        ["benchmarks/throughput_overhead.py"],
        ["benchmarks/timing_truth.py"],
        ["benchmarks/energy_cost.py"],
    ],
}

# What the wheel job runs in a virtualenv holding only torch and the wheel.
WHEEL_SMOKE = """
import torch, flops_callbacks
flops, macs, params = flops_callbacks.get_model_profile(
    torch.nn.Linear(4, 2), input_shape=(3, 4), print_profile=False, as_string=False)
assert (flops, macs, params) == (48, 24, 10), (flops, macs, params)
from flops_callbacks.reporting.picture import render_html  # its page template is package data
model = torch.nn.Linear(4, 2)
prof = flops_callbacks.FlopsProfiler(model)
prof.start_profile()
model(torch.ones(3, 4))
prof.stop_profile()
assert "<script" in render_html(prof.get_profile())
try:
    flops_callbacks.FlopsProfilerCallback
except ImportError as err:
    assert "pip install lightning" in str(err), err
else:
    raise AssertionError("lightning is not installed here: the callback must say what to install")
print("wheel ok: profiled a Linear with torch alone;", flops_callbacks.__version__)
"""


def venv_python(venv_dir: Path = VENV) -> Path:
    return venv_dir / ("Scripts" if os.name == "nt" else "bin") / "python"


def run(*args: str, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, cwd=ROOT, check=True, env={**os.environ, **(env or {})})


def setup(venv_dir: Path = VENV, torch: str = TORCH) -> None:
    """Create ``venv_dir`` and install ``torch`` and the package with every extra (once, again when
    pyproject changes)."""
    stamp = venv_dir / ".installed"
    if stamp.exists() and stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime:
        return
    if not venv_python(venv_dir).exists():
        venv.create(venv_dir, with_pip=True)
    pip = (str(venv_python(venv_dir)), "-m", "pip", "install", "-q")
    run(*pip, "--upgrade", "pip")
    run(*pip, torch)
    # DeepSpeed (a dev extra) builds no CUDA ops with DS_BUILD_OPS=0: its profiler and CPU engine need none.
    run(*pip, "-e", ".[dev,docs]", torch, env={"DS_BUILD_OPS": "0"})
    stamp.touch()


def wheel() -> None:
    """Build the wheel and check that it installs and profiles with only torch beside it."""
    with tempfile.TemporaryDirectory() as tmp:
        run(str(venv_python()), "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, ".")
        (built,) = Path(tmp).glob("flops_callbacks-*.whl")
        fresh = Path(tmp) / "venv"
        venv.create(fresh, with_pip=True)
        python = fresh / ("Scripts" if os.name == "nt" else "bin") / "python"
        run(str(python), "-m", "pip", "install", "-q", TORCH, str(built))
        run(str(python), "-c", WHEEL_SMOKE)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in (*JOBS, "wheel"):
        print(__doc__)
        return 2
    venv_dir, torch = (NEWEST_VENV, NEWEST_TORCH) if argv[0] == "test-newest" else (VENV, TORCH)
    setup(venv_dir, torch)
    if argv[0] == "wheel":
        wheel()
        return 0
    for job in JOBS[argv[0]]:
        run(str(venv_python(venv_dir)), *job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
