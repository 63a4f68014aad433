"""Run the demo (``examples/lightning/train.py`` on CPU) and keep the console summary it prints as the
docs' and the README's sample: ``docs/snippets/console.txt`` and the README's block between its
``console`` markers. ``python3 tasks.py console`` runs it; the sample is never pasted by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = ROOT / "docs" / "snippets" / "console.txt"
README = ROOT / "README.md"
START, END = "<!-- console: start (python3 tasks.py console) -->", "<!-- console: end -->"
TITLE = "flops_callbacks Flops Profiler"


def summary(stdout: str) -> list[str]:
    """The summary's lines, from its header rule to its closing rule."""
    lines = stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if TITLE in line and line.startswith("-"))
    last = next(i for i in range(first + 1, len(lines)) if lines[i] and set(lines[i]) == {"-"})
    return lines[first : last + 1]


def run_demo() -> list[str]:
    """The demo's summary, run in a scratch folder (its log dir reads as the example's default)."""
    example = ROOT / "examples" / "lightning" / "train.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [sys.executable, str(example)], cwd=scratch, env=env, capture_output=True, text=True, check=True
        )
    return summary(done.stdout)


def main() -> None:
    lines = run_demo()
    SNIPPET.parent.mkdir(parents=True, exist_ok=True)
    SNIPPET.write_text("\n".join(lines) + "\n")
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n```text\n" + "\n".join(lines) + f"\n```\n{END}{tail}")
    print(f"{len(lines)} lines -> {SNIPPET.relative_to(ROOT)} and README.md")


if __name__ == "__main__":
    main()
