"""The docs' picture of a profile, made from today's renderer: GPT-2 124M (12 layers) trained on CPU,
profiled by the step session as a callback would (a counting step, the module-timing steps, the check
and 3 clean steps), so the widths are module latencies measured with marks only, nothing counting.

MFU is against the CPU's measured matmul rate (``peak_flops="measure"``) and the roofline against its
copy bandwidth, measured here (the best of 5 copies of 64 MB), so that the picture shows every part.
The model is built from its config (random weights, nothing downloaded); headless Chromium shoots the
window's page (Debian: ``apt-get install chromium``). The PNG keeps, in two zTXt chunks, the page it
shows and the window's JSON: ``tests/test_docs.py`` checks that the page is what today's renderer draws
of that window. ``python3 tasks.py picture`` runs it.

    python benchmarks/picture_screenshot.py [--out docs/profile.png] [--html profile.html]
    python benchmarks/picture_screenshot.py --device cuda --html gpu.html --no-shot  # no Chromium there
    python benchmarks/picture_screenshot.py --from-html gpu.html --out docs/profile-gpu.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import transformers
from common import window_steps

from flops_callbacks.options import Options
from flops_callbacks.peaks import BF16, parameters_dtype
from flops_callbacks.phase_names import BACKWARD, OPTIMIZER_STEP
from flops_callbacks.reporting.profile_file import json_data
from flops_callbacks.reporting.publish import picture
from flops_callbacks.session.adapter_api import TrainingContext
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
    parser.add_argument(
        "--peak-bandwidth", type=float, help="bytes/s for the roofline (default on cpu: measured by copies)"
    )
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
    bandwidth = args.peak_bandwidth or (copy_bandwidth() if args.device == "cpu" else None)
    options = Options(
        profile_step=1,
        clean_steps=3,
        tokens_fn=lambda b: b.numel(),
        peak_flops="measure" if args.device == "cpu" else None,
        peak_bandwidth=bandwidth,
    )
    session = StepSession(options, "screenshot")
    dtype = BF16 if args.device == "cuda" else parameters_dtype(model)  # what a loop adapter says

    def context() -> TrainingContext:
        return TrainingContext(compute_dtype=dtype)

    session.train_start(0)
    for step in range(window_steps(1, 3).stop):  # step 0 warms up; then the window, as the run plan lays it
        session.step_start(step, model, context)
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
            keep(args.out, {PAGE: page, PROFILE: json.dumps(json_data(session.result))})


PAGE, PROFILE = "flops_callbacks page", "flops_callbacks profile"  # the zTXt chunks' keywords


def copy_bandwidth(megabytes: int = 64, repeats: int = 5) -> float:
    """This CPU's copy bandwidth: bytes read and written per second by the best of ``repeats`` copies."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def keep(png: Path, texts: dict[str, str]) -> None:
    """``texts`` written into ``png`` as compressed text chunks (zTXt) before its end."""
    blob = png.read_bytes()
    end = blob.rindex(b"IEND") - 4  # the IEND chunk's length field
    chunks = b""
    for keyword, text in texts.items():
        body = keyword.encode("latin-1") + b"\0\0" + zlib.compress(text.encode("utf-8"), 9)
        chunks += struct.pack(">I", len(body)) + b"zTXt" + body
        chunks += struct.pack(">I", zlib.crc32(b"zTXt" + body) & 0xFFFFFFFF)
    png.write_bytes(blob[:end] + chunks + blob[end:])
    print(f"{png}: {png.stat().st_size // 1024} KB with the page and the window it shows")


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
