"""HF ``generate()`` as a marked generation loop: its model calls are the steps, its logits are the tokens.

A pre-hook and a hook on the model alone (its outermost calls: every other module keeps torch's fast call
path) mark each step (an encoder-decoder's prefill begins at its encoder's call, which ``generate()``
makes first, and ends with the decoder's first call); a logits processor, appended to the caller's,
marks each token, as ``generate()`` calls it once per token on every decoding strategy that calls the
model once per token (:func:`check_one_call_per_token` refuses the others). All are removed
when ``generate()`` returns or raises. transformers is imported here only, when a generation is profiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flops_callbacks.generation.run import GenerationRun

__all__ = ["check_one_call_per_token", "generate_loop", "prompt_shape", "returned_sequences"]

# generate()'s settings under which its model calls are not one per token: assisted decoding (a draft's
# candidates checked several at a time, and the logits processor run on each candidate position) and
# classifier-free guidance (the processor calls the model a second time for each token)
_SEVERAL_CALLS = {
    "assistant_model": "assisted decoding",
    "prompt_lookup_num_tokens": "prompt lookup decoding",
    "assistant_early_exit": "self-speculative decoding",
    "use_mtp": "multi-token prediction",
    "guidance_scale": "classifier-free guidance",
}


def check_one_call_per_token(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse a ``generate()`` whose model calls are not one per token (:data:`_SEVERAL_CALLS`): its steps
    and tokens would be miscounted. Read from ``kwargs``, their ``generation_config`` and the model's. A
    cache object of the caller's is refused too: every run would share it (the first fills it)."""
    from transformers import GenerationMixin

    for key in ("past_key_values", "cache"):  # the cache's argument before transformers 5.24, and from it
        if kwargs.get(key) is not None:
            raise ValueError(
                f"{key} is not profiled: profile_generation calls generate() several times (warm-up, "
                "timed, counted), and one cache object would carry each call's tokens into the next; pass "
                "none (each call makes its own), or mark the steps of a loop of your own with "
                "profile_decode_loop"
            )

    configs = [kwargs.get("generation_config"), getattr(model, "generation_config", None)]
    # a model's own generate() (MusicGen, Janus) batches its guidance into one call a token
    own_generate = getattr(type(model), "generate", None) is not GenerationMixin.generate
    for key, what in _SEVERAL_CALLS.items():
        if key == "guidance_scale" and own_generate:
            continue
        value = (
            kwargs[key]
            if key in kwargs
            else next((getattr(c, key) for c in configs if getattr(c, key, None) is not None), None)
        )
        if value is None or value is False or (key == "guidance_scale" and value == 1):
            continue
        shown = type(value).__name__ if isinstance(value, torch.nn.Module) else repr(value)
        raise ValueError(
            f"{key}={shown} ({what}) is not profiled: its model calls are not one per token, which "
            "profile_generation's steps and tokens are; profile generate() without it, or mark the steps of "
            "a loop of your own with profile_decode_loop"
        )


def prompt_shape(kwargs: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(sequences, prompt positions per sequence, padding positions in all) of ``generate()``'s input."""
    found = (kwargs.get(key) for key in ("input_ids", "inputs", "inputs_embeds"))
    prompt = next((t for t in found if isinstance(t, torch.Tensor)), None)
    if prompt is None or prompt.dim() < 2:
        return None, None, None
    mask = kwargs.get("attention_mask")
    padding = int((mask == 0).sum()) if isinstance(mask, torch.Tensor) else 0
    return int(prompt.shape[0]), int(prompt.shape[1]), padding


def returned_sequences(output: Any) -> int | None:
    """How many sequences ``generate()`` returned (its output's rows: ``num_return_sequences`` per prompt),
    or None where the output is not one of its own."""
    sequences = getattr(output, "sequences", output)  # a GenerateOutput (return_dict_in_generate) or a tensor
    return int(sequences.shape[0]) if isinstance(sequences, torch.Tensor) and sequences.dim() == 2 else None


class _TokenMarks:
    """A logits processor that marks a token on ``run`` and hands the scores on untouched."""

    def __init__(self, run: GenerationRun) -> None:
        self.run = run

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.run.token()
        return scores


def generate_loop(model: torch.nn.Module, kwargs: dict[str, Any]) -> Callable[[GenerationRun], Any]:
    """The loop that runs ``model.generate(**kwargs)`` once with its steps and tokens marked on ``run``."""
    from transformers import LogitsProcessorList

    encoder = _encoder(model)

    def loop(run: GenerationRun) -> Any:
        def before(module: torch.nn.Module, args: Any) -> None:
            run.step_started(forget_between=False)  # inside the model's call: the engine's stack stays

        def after(module: torch.nn.Module, args: Any, output: Any) -> None:
            run.step_ended(output)

        processors = LogitsProcessorList([*(kwargs.get("logits_processor") or ()), _TokenMarks(run)])
        # the step begins before the caller's own pre-hooks and ends after their hooks: their time is its
        handles = [model.register_forward_pre_hook(before, prepend=True), model.register_forward_hook(after)]
        if encoder is not None:  # the prefill begins with the encoder's call
            handles.append(encoder.register_forward_pre_hook(before, prepend=True))
        try:
            return model.generate(**{**kwargs, "logits_processor": processors})  # type: ignore[operator]
        finally:
            for handle in handles:
                handle.remove()

    return loop


def _encoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """An encoder-decoder model's encoder (``generate()`` calls it before the decoder's first call)."""
    config = getattr(model, "config", None)
    get_encoder = getattr(model, "get_encoder", None)
    if not getattr(config, "is_encoder_decoder", False) or not callable(get_encoder):
        return None
    encoder = get_encoder()
    return encoder if isinstance(encoder, torch.nn.Module) else None
