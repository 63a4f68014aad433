"""The README's screenshot of the profile picture: GPT-2 124M (12 layers), one training step on CPU.

Builds the model from its config (random weights, nothing downloaded), runs one step unprofiled (so the
first call's set-up is not in the timings), profiles the next forward + backward with the Tracer,
renders the page of the fastest of a few profiled steps (a shared machine's neighbours slow some)
and screenshots it with headless Chromium (Debian: ``apt-get install chromium``).

    python benchmarks/picture_screenshot.py [--out docs/profile.png] [--html profile.html]
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

from flops_callbacks.picture import render_html
from flops_callbacks.tracer import Tracer
from flops_callbacks.units import duration_to_string, flops_to_string, number_to_string, params_to_string


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one is steadiest when shared)")
    parser.add_argument("--repeats", type=int, default=3, help="profiled steps; the fastest is shown")
    parser.add_argument("--out", type=Path, default=Path("docs/profile.png"))
    parser.add_argument("--html", type=Path, help="also keep the page here")
    parser.add_argument("--size", default="1400,850", help="window width,height in pixels")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs the chromium binary on PATH (Debian: apt-get install -y chromium)")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers))
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    model(ids, labels=ids).loss.backward()  # warm-up, not profiled
    model.zero_grad(set_to_none=True)
    profiles = []
    for _ in range(args.repeats):
        tracer = Tracer(model)
        tracer.start()
        try:
            model(ids, labels=ids).loss.backward()
        finally:
            tracer.stop()
        model.zero_grad(set_to_none=True)
        profiles.append(tracer.profile())
    profile = min(profiles, key=lambda p: p.fwd_latency + p.bwd_latency)  # the least disturbed by neighbours

    step = profile.fwd_latency + profile.bwd_latency
    summary = [
        ("model", f"GPT-2, n_embd {model.config.n_embd}"),
        ("batch x sequence", f"{args.batch} x {args.seq}"),
        ("params", params_to_string(profile.params)),
        (
            "flops fwd / bwd",
            " / ".join(number_to_string(f).strip() for f in (profile.fwd_flops, profile.bwd_flops)),
        ),
        (
            "latency fwd / bwd",
            " / ".join(duration_to_string(t) for t in (profile.fwd_latency, profile.bwd_latency)),
        ),
        ("achieved", flops_to_string(profile.model_flops / step) if step > 0 else "n/a"),
        ("device", f"{profile.device}, {args.threads} thread{'s' if args.threads > 1 else ''}"),
    ]
    title = f"GPT-2, {args.layers} layers: one training step, profiled"
    page = render_html(profile, title=title, summary=summary)
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(args.html or Path(tmp) / "profile.html")
        html.write_text(page, encoding="utf-8")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp}/chromium", f"--window-size={args.size}",
             f"--screenshot={args.out.resolve()}", html.resolve().as_uri()],
            check=True, capture_output=True,
        )  # fmt: skip
    print(f"{args.out}: {args.out.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
