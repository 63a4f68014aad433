"""Both callbacks built from a DeepSpeed config's ``flops_profiler`` block, as DeepSpeed users write it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from flops_callbacks.deepspeed_api import deepspeed_callback_kwargs
from flops_callbacks.session import StepSession

C = TypeVar("C", bound="FromDeepSpeedConfig")


class FromDeepSpeedConfig:
    """Adds ``from_deepspeed_config`` to a callback that holds a :class:`StepSession`."""

    session: StepSession

    @classmethod
    def from_deepspeed_config(cls: type[C], config: Mapping[str, Any], **kwargs: Any) -> C:
        """The callback a DeepSpeed config asks for (the whole config or its ``flops_profiler`` block;
        ``kwargs`` add or override arguments). ``enabled: false`` (DeepSpeed's default) gives a callback
        that does nothing; ``recompute_fwd_factor`` is ignored with a one-line note: recompute is measured.
        """
        found = deepspeed_callback_kwargs(config)
        callback = cls(**{**(found or {}), **kwargs})
        if found is None:
            callback.session.disable()
        return callback
