"""Truth of a generation's reported times: ours against outside timers on the same model, interleaved.

A tiny GPT-2 and a tiny Llama (grouped-query attention) built from configs, batch 2, prompt 64 (the second
sequence left-padded by 8), 32 new tokens, greedy. Per repeat, in turn:

* time to first token, true: ``perf_counter`` around ``generate(max_new_tokens=1)``, the median of 3;
* inter-token latency, true: the median gap between the ``perf_counter`` stamps of a ``LogitsProcessor``
  in 3 plain ``generate(max_new_tokens=32)``;
* reported: ``profile_generation(..., runs=3)``'s ``time_to_first_token`` and
  ``decode_latency_per_token`` (medians of its 3 timed runs).

Printed: the medians over ``--repeats`` of each side, their ratio, and the median of each repeat's own
ratio (the two sides a few hundred ms apart: load that drifts over the run cancels). Goal on CPU: within
[0.9, 1.1]. On a loaded machine the spread is wide: run with ``--threads 1`` and more repeats.

``--models`` picks the models (GPT-2 124M too: ``gpt2-124m``); where the device's peaks are known (a GPU),
each model's prefill and decode MFU and MBU are printed too.

    python benchmarks/generation_truth.py [--repeats 7] [--threads 1] [--device cuda --bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import transformers

from flops_callbacks import metrics, profile_generation

BATCH, PROMPT, NEW, PADDED = 2, 64, 32, 8


def gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=128)
    )


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2_124m() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config())  # the prompts draw ids below 512


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt2": gpt2, "llama-gqa": llama, "gpt2-124m": gpt2_124m}


class Stamps:
    """A logits processor that stamps ``perf_counter`` (after a synchronization on a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="the model's weights in bf16")
    parser.add_argument("--models", default="gpt2,llama-gqa", help=f"of {', '.join(MODELS)}")
    args = parser.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; accepted: {', '.join(MODELS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, {args.repeats} repeats (medians)")  # fmt: skip
    print(f"{'model':<10} {'figure':<24} {'true':>10} {'reported':>10} {'ratio':>7} {'paired':>7}")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = MODELS[name]().eval().to(device, dtype)
        ids = torch.randint(3, 512, (BATCH, PROMPT), device=device)
        mask = torch.ones_like(ids)
        mask[1, :PADDED] = 0
        kwargs = {"input_ids": ids, "attention_mask": mask, "do_sample": False, "pad_token_id": 0}
        model.generate(**kwargs, max_new_tokens=NEW)  # warm-up
        true_ttft, true_gap, ttft, gap = [], [], [], []
        for _ in range(args.repeats):
            firsts, gaps = [], []
            for _ in range(3):
                sync(device)
                start = time.perf_counter()
                model.generate(**kwargs, max_new_tokens=1)
                sync(device)
                firsts.append(time.perf_counter() - start)
                stamps = Stamps(device)
                processors = transformers.LogitsProcessorList([stamps])
                model.generate(**kwargs, max_new_tokens=NEW, logits_processor=processors)
                gaps += [b - a for a, b in zip(stamps.times, stamps.times[1:], strict=False)]
            true_ttft.append(statistics.median(firsts))
            true_gap.append(statistics.median(gaps))
            profile = profile_generation(model, **kwargs, max_new_tokens=NEW, runs=3, warm_up=0)
            ttft.append(profile.metrics[metrics.TIME_TO_FIRST_TOKEN])
            gap.append(profile.metrics[metrics.DECODE_LATENCY_PER_TOKEN])
        for figure, true, reported in (
            ("time_to_first_token", true_ttft, ttft),
            ("decode_latency_per_token", true_gap, gap),
        ):
            t, r = statistics.median(true), statistics.median(reported)
            paired = statistics.median(b / a for a, b in zip(true, reported, strict=True))
            print(f"{name:<10} {figure:<24} {t * 1e3:>8.3f}ms {r * 1e3:>8.3f}ms {r / t:>7.3f} {paired:>7.3f}")
        rates = {key.split("/")[-1]: profile.metrics.get(key) for key in metrics.GENERATION_WITH_PEAK}
        if any(v is not None for v in rates.values()):
            print(f"{name:<10} " + ", ".join(f"{k} {v:.4f}" for k, v in rates.items() if v is not None))


if __name__ == "__main__":
    main()
