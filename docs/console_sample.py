"""Run the demo (``examples/lightning/train.py`` on CPU) and keep the console summary it prints as the
docs' and the README's sample: ``docs/snippets/console.txt``, then the pages' ``console`` blocks rewritten
from it (``docs/generate.py``). ``python3 tasks.py console`` runs it; the sample is never pasted by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = ROOT / "docs" / "snippets" / "console.txt"
TITLE = "flops_callbacks Flops Profiler"


def summary(stdout: str) -> list[str]:
    """The summary's lines, from its header rule to its closing rule."""
    lines = stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if TITLE in line and line.startswith("-"))
    last = next(i for i in range(first + 1, len(lines)) if lines[i] and set(lines[i]) == {"-"})
    return lines[first : last + 1]


def run_demo() -> list[str]:
    """The demo's summary, run in a scratch folder (its log dir reads as the example's default), on one
    torch thread: on a machine other jobs share, a second thread waits for a core at every matmul."""
    example = ROOT / "examples" / "lightning" / "train.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [sys.executable, str(example)], cwd=scratch, env=env, capture_output=True, text=True, check=True
        )
    return summary(done.stdout)


def main() -> None:
    lines = run_demo()
    SNIPPET.parent.mkdir(parents=True, exist_ok=True)
    SNIPPET.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} lines -> {SNIPPET.relative_to(ROOT)}")
    subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py")], check=True)


if __name__ == "__main__":
    main()
