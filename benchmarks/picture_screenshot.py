"""The README's screenshot of the profile picture: GPT-2 124M (12 layers) trained on CPU, profiled by
the step session as a callback would (a counting step, a module-timing step, a clean step), so the
widths are module latencies measured with marks only, nothing counting. Builds the model from its
config (random weights, nothing downloaded) and screenshots the window's page with headless Chromium
(Debian: ``apt-get install chromium``).

    python benchmarks/picture_screenshot.py [--out docs/profile.png] [--html profile.html]
    python benchmarks/picture_screenshot.py --device cuda --html gpu.html --no-shot  # no Chromium there
    python benchmarks/picture_screenshot.py --from-html gpu.html --out docs/profile-gpu.png
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from common import window_steps

from flops_callbacks.options import Options
from flops_callbacks.phase_names import BACKWARD, OPTIMIZER_STEP
from flops_callbacks.reporting.publish import picture
from flops_callbacks.session.step_session import StepSession


class Quiet:
    """A sink that keeps nothing: the page is rendered from the session's result."""

    is_logging_rank = True

    def log_dir(self) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def console(self, text: str) -> None:
        pass

    def log_report(self, text: str, html: str, step: int) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one is steadiest when shared)")
    parser.add_argument("--out", type=Path, default=Path("docs/profile.png"))
    parser.add_argument("--html", type=Path, help="also keep the page here")
    parser.add_argument("--size", default="1400,850", help="window width,height in pixels")
    parser.add_argument("--device", default="cpu", help="where the model trains (cuda: bf16 autocast)")
    parser.add_argument("--no-shot", action="store_true", help="write --html only, take no screenshot")
    parser.add_argument("--from-html", type=Path, help="screenshot this page; train nothing")
    args = parser.parse_args()
    if args.no_shot and (args.html is None or args.from_html is not None):
        parser.error("--no-shot writes the page only: it needs --html and takes no --from-html")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None and not args.no_shot:
        sys.exit("needs the chromium binary on PATH (Debian: apt-get install -y chromium)")
    if args.from_html is not None:
        shoot(chromium, args.from_html, args.out, args.size)
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers)).to(args.device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=args.device == "cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    session = StepSession(Options(profile_step=1, clean_steps=1, tokens_fn=lambda b: b.numel()), "screenshot")
    session.train_start(0)
    for step in range(window_steps(1, 1).stop):  # step 0 warms up; then the window, as the run plan lays it
        session.step_start(step, model)
        session.micro_batch_start(ids)
        with autocast:
            loss = model(ids, labels=ids).loss
        session.phase(BACKWARD)
        loss.backward()
        session.micro_batch_end()
        session.phase(OPTIMIZER_STEP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        session.step_end(step + 1, Quiet())
    assert session.result is not None
    page = picture(session.result)
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(args.html or Path(tmp) / "profile.html")
        html.write_text(page, encoding="utf-8")
        if not args.no_shot:
            shoot(chromium, html, args.out, args.size)


def shoot(chromium: str | None, html: Path, out: Path, size: str) -> None:
    """A headless Chromium screenshot of the page ``html`` into ``out``."""
    assert chromium is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp}/chromium", f"--window-size={size}",
             f"--screenshot={out.resolve()}", html.resolve().as_uri()],
            check=True, capture_output=True,
        )  # fmt: skip
    print(f"{out}: {out.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
