"""What the "6 x params x tokens" rule of thumb and PaLM's formula claim for a profiled step, beside
what was measured: the rule (Kaplan et al. 2020, section 2.1) with N the non-embedding parameters,
PaLM's ``6N + 12LHQT`` (Chowdhery et al. 2022, appendix B) with self-attention's matmuls, and for a
mixture of experts both again with the active parameters per token.

Pure functions of a finished profile, the model's config (transformers' attribute names) and the
model: the estimates are shown next to the measured count, never used in its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flops_callbacks.parallel import stored_numel
from flops_callbacks.profile import ModuleProfile, Profile
from flops_callbacks.units import number_to_string, params_to_string

__all__ = [
    "active_params",
    "Attention",
    "attention_of",
    "embedding_params",
    "estimate_rows",
    "expert_modules",
    "is_encoder_decoder",
    "model_config",
    "palm_attention_flops",
    "Routing",
    "routing_of",
    "six_n_d",
]

# transformers' names for the routed experts per MoE layer and the experts each token goes to
_NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_top_k", "top_k")
_TABLES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


@dataclass(frozen=True)
class Routing:
    """How a mixture-of-experts layer routes a token: to ``experts_per_token`` of ``num_experts``."""

    num_experts: int
    experts_per_token: int


@dataclass(frozen=True)
class Attention:
    """PaLM's attention sizes: ``layers`` (L), ``heads`` (H, query heads), ``head_dim`` (Q)."""

    layers: int
    heads: int
    head_dim: int


def _int(config: Any, *names: str) -> int | None:
    return next((v for n in names if isinstance(v := getattr(config, n, None), int) and v > 0), None)


def routing_of(config: Any) -> Routing | None:
    """The routing a model config declares (None for a dense model, or a config without both numbers).

    Args:
        config: the model's config (transformers' attribute names).
    """
    experts = next(
        (v for n in _NUM_EXPERTS if isinstance(v := getattr(config, n, None), int) and v > 1), None
    )
    per_token = _int(config, *_EXPERTS_PER_TOKEN)
    if experts is None or per_token is None:
        return None
    return Routing(experts, min(per_token, experts))


def model_config(model: torch.nn.Module) -> Any:
    """The model's config (a transformers config: ``model.config``, or a submodule's), if it has one.

    Args:
        model: the model (wrapped or not).
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if callable(getattr(config, "to_dict", None)):
            return config
    return None


def is_encoder_decoder(model: torch.nn.Module) -> bool:
    """Whether the model's config says it is an encoder-decoder (T5, BART).

    Args:
        model: the model (wrapped or not).
    """
    return bool(getattr(model_config(model), "is_encoder_decoder", False))


def attention_of(config: Any) -> Attention | None:
    """L, H and Q of a decoder-only config (transformers' names; ``head_dim`` where set, else the hidden
    size over the heads); None where one is missing, or for an encoder-decoder (PaLM's formula is for
    one stack of self-attention).

    Args:
        config: the model's config (transformers' attribute names).
    """
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(config, "num_attention_heads", "n_head")
    if layers is None or heads is None:
        return None
    head_dim = _int(config, "head_dim")
    if head_dim is None:
        hidden = _int(config, "hidden_size", "n_embd", "d_model")
        if hidden is None or hidden % heads:
            return None
        head_dim = hidden // heads
    return Attention(layers, heads, head_dim)


def embedding_params(model: torch.nn.Module) -> int:
    """Parameters of the model's embedding tables that do no arithmetic: each ``nn.Embedding`` /
    ``nn.EmbeddingBag`` weight once, except one another module also holds (a tied LM head).

    An embedding table is looked up, not multiplied, so its rows do no arithmetic; a table tied to an
    output layer (GPT-2's LM head shares the token table) does a matmul per token as the head, so it
    stays in N, once.

    Args:
        model: the model whose embedding tables are counted.
    """
    others = {
        id(p)
        for m in model.modules()
        if not isinstance(m, _TABLES)
        for p in m._parameters.values()
        if p is not None
    }
    tables = {id(m.weight): m.weight for m in model.modules() if isinstance(m, _TABLES)}
    return sum(stored_numel(w) for key, w in tables.items() if key not in others)


def expert_modules(profile: Profile) -> list[ModuleProfile]:
    """The routed-experts modules (transformers' ``*.experts``, ``MixtralExperts`` & co.), outermost
    only; a shared expert, which every token runs, is not one of them.

    Args:
        profile: the profile whose modules are searched.
    """
    found = [
        m
        for m in profile.modules.values()
        if m.name.rsplit(".", 1)[-1] == "experts" or m.class_name.endswith("Experts")
    ]
    names = [m.name for m in found]
    return [m for m in found if not any(m.name.startswith(other + ".") for other in names)]


def active_params(total_params: int, expert_params: int, routing: Routing) -> int:
    """Parameters one token uses: all but the experts it is not routed to.

    Args:
        total_params: all the model's parameters.
        expert_params: the routed experts' parameters.
        routing: how many experts there are and how many a token runs.
    """
    return total_params - expert_params + expert_params * routing.experts_per_token // routing.num_experts


def six_n_d(params: int, tokens: int) -> int:
    """The rule of thumb for one training step: 6 flops per parameter per token (2 forward, 4 backward).

    Args:
        params: N, the parameters counted.
        tokens: D, the step's tokens.
    """
    return 6 * params * tokens


def palm_attention_flops(attention: Attention, seq_len: int, tokens: int) -> int:
    """PaLM's attention term for ``tokens`` tokens in sequences of ``seq_len``: 12 x L x H x Q x T each.


    L layers, H heads, Q the head dimension, T the sequence length: QK^T and AV, 2 x Q x T flops each
    per head forward, x3 for forward + backward; the whole T x T matrix, causal or not.
    Args:
        attention: L, H and Q of the model.
        seq_len: T, the sequences' length.
        tokens: the step's tokens.
    """
    return 12 * attention.layers * attention.heads * attention.head_dim * seq_len * tokens


def estimate_rows(
    profile: Profile,
    tokens: int,
    config: Any = None,
    *,
    model: torch.nn.Module | None = None,
    samples: int | None = None,
) -> list[tuple[str, str]]:
    """Report rows: what "6 x non-embedding params x tokens" claims for the step and, where the config
    and the batch give L, H, Q and T, PaLM's model flops with attention; each with the numbers it is
    made of and the measured fwd+bwd flops as a multiple of it. For a mixture of experts, the same with
    the active parameters per token.

    Args:
        profile: the counted step's profile.
        tokens: the counted step's tokens.
        config: the model's config (None: the rule without attention or experts).
        model: the model, to find its embedding tables (None: none are left out).
        samples: the counted step's sequences, for T = tokens / samples (None: no attention term).
    """
    if tokens <= 0:
        raise ValueError(f"tokens must be a positive number of tokens in the profiled step, got {tokens!r}")
    measured = profile.model_flops
    tables = embedding_params(model) if model is not None else 0
    params = profile.params - tables
    claimed = six_n_d(params, tokens)
    made_of = (
        f"6 x {params_to_string(params)} x {tokens}, embedding tables left out: {params_to_string(tables)}"
    )
    rows = [_estimate_row("6 x non-embedding params x tokens", claimed, made_of, measured)]
    n = "non-embedding params"
    routing = routing_of(config) if config is not None else None
    experts = expert_modules(profile)
    if routing is not None and experts:
        params = active_params(params, sum(m.params for m in experts), routing)
        claimed, n = six_n_d(params, tokens), "active non-embedding params"
        rows = [
            ("experts per token", f"{routing.experts_per_token} of {routing.num_experts}"),
            ("active non-embedding params per token", params_to_string(params)),
            *rows,
            _estimate_row(
                f"6 x {n} x tokens", claimed, f"6 x {params_to_string(params)} x {tokens}", measured
            ),
        ]
    attention = attention_of(config)
    if attention is None or not samples or samples < 0 or tokens % samples:
        return rows
    seq_len = tokens // samples
    term = palm_attention_flops(attention, seq_len, tokens)
    sizes = f"L={attention.layers}, H={attention.heads}, Q={attention.head_dim}, T={seq_len}"
    return [
        *rows,
        _estimate_row(
            f"6 x {n} x tokens + 12 x L x H x Q x T x tokens (PaLM)",
            claimed + term,
            f"{number_to_string(claimed)}flops + {number_to_string(term)}flops of attention, {sizes}",
            measured,
        ),
    ]


def _estimate_row(label: str, claimed: int, made_of: str, measured: int) -> tuple[str, str]:
    """``claimed`` flops, what they are made of, and the measured flops as a multiple of them."""
    ratio = measured / claimed
    return (
        label,
        f"{number_to_string(claimed)}flops = {made_of} (measured fwd+bwd flops: {ratio:.2f}x this)",
    )
