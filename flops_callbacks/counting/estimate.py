"""What the "6 x params x tokens" rule of thumb would claim for a profiled model, beside what was measured.

The rule (Kaplan et al. 2020) assumes every parameter does one multiply-accumulate per token forward
and two backward. A mixture-of-experts model runs only ``experts_per_token`` of its ``num_experts``
experts for each token, so with all its parameters the rule overstates the work several times over;
with the active parameters per token it comes close. The report shows both next to the measured
count, so a reader sees how far the usual estimate is from the truth for their model.

Pure functions of a finished profile and the model's config (any object with the usual transformers
attribute names): no torch, no framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flops_callbacks.profile import ModuleProfile, Profile
from flops_callbacks.units import number_to_string, params_to_string

__all__ = ["active_params", "estimate_rows", "expert_modules", "Routing", "routing_of", "six_n_d"]

# transformers' names for the routed experts per MoE layer and the experts each token goes to
_NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_top_k", "top_k")


@dataclass(frozen=True)
class Routing:
    """How a mixture-of-experts layer routes a token: to ``experts_per_token`` of ``num_experts``."""

    num_experts: int
    experts_per_token: int


def routing_of(config: Any) -> Routing | None:
    """The routing a model config declares (None for a dense model, or a config without both numbers)."""
    experts = next(
        (v for n in _NUM_EXPERTS if isinstance(v := getattr(config, n, None), int) and v > 1), None
    )
    per_token = next(
        (v for n in _EXPERTS_PER_TOKEN if isinstance(v := getattr(config, n, None), int) and v > 0), None
    )
    if experts is None or per_token is None:
        return None
    return Routing(experts, min(per_token, experts))


def expert_modules(profile: Profile) -> list[ModuleProfile]:
    """The routed-experts modules (transformers' ``*.experts``, ``MixtralExperts`` & co.), outermost
    only; a shared expert, which every token runs, is not one of them."""
    found = [
        m
        for m in profile.modules.values()
        if m.name.rsplit(".", 1)[-1] == "experts" or m.class_name.endswith("Experts")
    ]
    names = [m.name for m in found]
    return [m for m in found if not any(m.name.startswith(other + ".") for other in names)]


def active_params(total_params: int, expert_params: int, routing: Routing) -> int:
    """Parameters one token uses: all but the experts it is not routed to."""
    return total_params - expert_params + expert_params * routing.experts_per_token // routing.num_experts


def six_n_d(params: int, tokens: int) -> int:
    """The rule of thumb for one training step: 6 flops per parameter per token (2 forward, 4 backward)."""
    return 6 * params * tokens


def estimate_rows(profile: Profile, tokens: int, config: Any = None) -> list[tuple[str, str]]:
    """Report rows: what "6 x params x tokens" claims for the step, and the measured fwd+bwd flops as a
    multiple of it; for a mixture of experts, the same with the active parameters per token."""
    if tokens <= 0:
        raise ValueError(f"tokens must be a positive number of tokens in the profiled step, got {tokens!r}")
    measured = profile.model_flops
    rows = [_estimate_row("6 x params x tokens", profile.params, tokens, measured)]
    routing = routing_of(config) if config is not None else None
    experts = expert_modules(profile)
    if routing is None or not experts:
        return rows
    active = active_params(profile.params, sum(m.params for m in experts), routing)
    return [
        ("experts per token", f"{routing.experts_per_token} of {routing.num_experts}"),
        ("active params per token", params_to_string(active)),
        *rows,
        _estimate_row("6 x active params x tokens", active, tokens, measured),
    ]


def _estimate_row(label: str, params: int, tokens: int, measured: int) -> tuple[str, str]:
    claimed = six_n_d(params, tokens)
    ratio = measured / claimed
    return (label, f"{number_to_string(claimed)}flops (measured fwd+bwd flops: {ratio:.2f}x this)")
