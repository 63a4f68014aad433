"""One run of a generation, recorded: its steps' clock marks (a timed run) or their counts (the counting run).

A generation is a prefill (the prompt's forward: the steps before the first token) and decode steps (one
token for each sequence). Whoever runs it (``generate()``'s model calls, or a loop of the user's marking
its steps) tells a :class:`GenerationRun` where each step starts and ends and when each token is out; the
run keeps clock marks only, or, in the counting run, the engine's profile of each step
(:class:`~flops_callbacks.counting.engine.CountingEngine`, reset between steps, so the work between them is no
step's). Why runs of two kinds and not one run that counts and times: counting runs every op through
Python, several times a clean step's time on a model of small ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.profile import Profile
from flops_callbacks.timing.clock import Clock
from flops_callbacks.timing.energy import EnergyCounter, read_failure
from flops_callbacks.timing.energy_figures import Reading, read

__all__ = ["GenerationRun", "RunTimes", "cache_bytes", "output_cache_bytes"]


@dataclass(frozen=True)
class RunTimes:
    """One timed run in seconds: the whole run, its start to the first token, each model step's span and
    the gaps between consecutive tokens."""

    total: float
    first_token: float
    tokens: int  # tokens out per sequence
    prefill_steps: int  # the steps before the first token: the prefill (in chunks when more than one)
    steps: tuple[float, ...]  # the prefill's first, then each decode step's
    token_gaps: tuple[float, ...]  # token k+1's time less token k's: the inter-token latencies
    # the energy counter at the run's start, its first token and its end (empty: not read)
    energy: tuple[Reading, ...] = ()


class GenerationRun:
    """The marks (timed) or the per-step profiles (``engine`` given: the counting run) of one run;
    ``energy``: a timed run's energy counter, read at its start (the device's queue drained), its first
    token (on the host, without waiting) and its end (the queue drained after its end mark)."""

    def __init__(
        self,
        clock: Clock,
        engine: CountingEngine | None = None,
        energy: EnergyCounter | None = None,
        model_calls: Callable[[], int] | None = None,
    ) -> None:
        self.clock = clock
        # the module-timing run: the model's calls so far, read at each step's end (``call_ends``)
        self._model_calls = model_calls
        self.call_ends: list[int] = []
        self.engine = engine
        self.energy = energy
        self.energy_failure = ""  # why a read of the counter failed ("": none did)
        self._readings: list[Reading] = []
        self.failure = ""  # what went wrong in the counting ("": nothing): counting stops there
        self.profiles: list[Profile] = []  # the counting run's, one per step
        self.kv_cache_bytes: int | None = None
        self.matmul_dtype: torch.dtype | None = None  # what the counted matmuls produced (autocast's)
        self.cache_failure = ""  # why reading the KV cache's bytes failed ("": it did not): none reported
        self.prefill_steps = 0  # steps that ended before the first token
        self._tokens_out = 0
        self._start: Any = None
        self._end: Any = None
        self._step_start: Any = None
        self._steps: list[tuple[Any, Any]] = []
        self._tokens: list[Any] = []

    @property
    def counting(self) -> bool:
        return self.engine is not None

    @property
    def tokens_out(self) -> int:
        """Tokens out so far (one for each sequence)."""
        return self._tokens_out

    @property
    def steps(self) -> int:
        """Model steps recorded so far (the prefill included)."""
        return len(self.profiles) if self.counting else len(self._steps)

    def begin(self) -> None:
        if self.engine is not None:
            self.engine.start()
        if self.energy is not None:
            self.clock.synchronize()
            self._read_energy()
        self._start = self.clock.mark()

    def end(self) -> None:
        self._end = self.clock.mark()
        if self.engine is not None:
            self.engine.stop()
        if self.energy is not None:
            self.clock.synchronize()
            self._read_energy()

    def _read_energy(self) -> None:
        """The counter now; a failure (the profiler's own work) is kept, and the run reads no more."""
        if self.energy is None:
            return
        try:
            self._readings.append(read(self.energy))
        except Exception as error:
            self.energy_failure = read_failure(self.energy, error)
            self.energy, self._readings = None, []

    def step_started(self, *, forget_between: bool = True) -> None:
        """A step begins. ``forget_between``: drop what was counted since the last step (False from inside
        a module hook, where the engine's stack must stay: the work between steps is then outside the
        model, and no step's total holds it)."""
        if self.engine is not None:
            if forget_between:
                self.engine.reset()
            return
        if self._step_start is None:  # a step already begun goes on (an encoder's call, then the decoder's)
            self._step_start = self.clock.mark()

    def step_ended(self, output: Any = None) -> None:
        """A step ends; ``output`` (the model's) is searched for its KV cache."""
        if not self._tokens_out:
            self.prefill_steps += 1
        if self.engine is not None:
            if self.failure:
                return
            try:
                self.profiles.append(self.engine.profile())
                self.matmul_dtype = self.matmul_dtype or self.engine.matmul_dtype()  # the prefill's, mostly
                self.engine.reset()
            except Exception as error:  # the profiler's own work: the user's generation goes on
                self.failure = f"reading step {len(self.profiles)}'s counts ({type(error).__name__}: {error})"
                return
            self._read_cache(output_cache_bytes, output)
            return
        end = self.clock.mark()
        if self._model_calls is not None:
            self.call_ends.append(self._model_calls())
        if self._step_start is not None:
            self._steps.append((self._step_start, end))
            self._step_start = None

    def step_calls(self, step: int) -> range:
        """The indices of the model's calls in ``step`` (a module-timing run's): those after the previous
        step's end up to its own (a marked block may hold several: a prompt prefilled in chunks by hand)."""
        ends = self.call_ends
        if not 0 <= step < len(ends):
            return range(0)
        return range(ends[step - 1] if step else 0, ends[step])

    def token(self) -> None:
        """A token (one for each sequence) is out."""
        self._tokens_out += 1
        if self.engine is None:
            self._tokens.append(self.clock.mark())
            if self._tokens_out == 1:
                self._read_energy()  # the prefill's end

    # --- a loop of the caller's marks its steps with these -------------------------------------------

    @contextmanager
    def prefill(self) -> Iterator[None]:
        """The prompt's forward: the run's first step; its token is out at the end of the block."""
        if self.steps:
            raise RuntimeError("prefill() is the run's first step: mark it once, before any decode_step()")
        yield from self._step()

    @contextmanager
    def decode_step(self) -> Iterator[None]:
        """One decode step (a token for each sequence, out at the end of the block), after the prefill."""
        if not self.steps and not self.failure:
            raise RuntimeError("decode_step() comes after the run's prefill(): mark the prefill first")
        yield from self._step()

    def _step(self) -> Iterator[None]:
        self.step_started()
        yield
        self.step_ended()
        self.token()

    def kv_cache(self, cache: Any) -> None:
        """The KV cache (a cache object or tuples of tensors): its bytes are reported as the cache's at
        the end of the run."""
        if self.engine is not None:
            self._read_cache(cache_bytes, cache)

    def _read_cache(self, bytes_of: Callable[[Any], int | None], found: Any) -> None:
        """The cache's bytes, kept where found; a failure (the profiler's own work) reports none, and the
        counts and the user's loop go on."""
        if self.cache_failure:
            return
        try:
            size = bytes_of(found)
        except Exception as error:
            self.cache_failure, self.kv_cache_bytes = f"{type(error).__name__}: {error}", None
            return
        if size is not None:
            self.kv_cache_bytes = size

    def times(self) -> RunTimes:
        """The run's seconds (synchronizes once)."""
        self.clock.synchronize()
        seconds = self.clock.seconds
        tokens = self._tokens
        return RunTimes(
            total=seconds(self._start, self._end),
            first_token=seconds(self._start, tokens[0]) if tokens else 0.0,
            tokens=len(tokens),
            prefill_steps=self.prefill_steps,
            steps=tuple(seconds(a, b) for a, b in self._steps),
            token_gaps=tuple(seconds(a, b) for a, b in zip(tokens, tokens[1:], strict=False)),
            energy=tuple(self._readings) if len(self._readings) == 3 else (),
        )


def output_cache_bytes(output: Any) -> int | None:
    """Bytes of the KV cache in a model's output (its ``cache`` or ``past_key_values``); None without one."""
    if not isinstance(output, Mapping):  # a ModelOutput is a Mapping; a tuple output names nothing
        return None
    found = (output[key] for key in ("cache", "past_key_values") if output.get(key) is not None)
    return cache_bytes(next(found, None))


def cache_bytes(cache: Any) -> int | None:
    """Bytes of the tensors a KV cache holds: a cache object (its layers' keys and values, not the int64
    or bool tensors it keeps its lengths and windows in) or nested tuples of tensors; None where there is
    none. Each view counts once, and the views of one storage (a
    preallocated buffer's layers, a fused key-value tensor's halves) never more than the storage."""
    views: dict[Any, dict[tuple[Any, ...], int]] = {}  # storage -> each distinct view's bytes
    capacity: dict[Any, int] = {}  # storage -> its bytes

    def walk(found: Any, depth: int) -> bool:
        if isinstance(found, torch.Tensor):
            if found.dtype in (torch.int64, torch.bool):  # a cache's bookkeeping (its length, a window)
                return False
            if found.device.type == "meta":  # no storage to share
                storage, size = id(found), found.nbytes
            else:
                storage, size = found.untyped_storage().data_ptr(), found.untyped_storage().nbytes()
            view = (found.storage_offset(), tuple(found.shape), found.stride(), found.dtype)
            views.setdefault(storage, {})[view] = found.nbytes
            capacity[storage] = size
            return True
        if depth > 4:
            return False
        if isinstance(found, (tuple, list)):
            items: Any = found
        elif hasattr(found, "__dict__") and not isinstance(found, (torch.nn.Module, type)):
            items = vars(found).values()
        else:
            return False
        return any([walk(item, depth + 1) for item in items])  # a list: every item walked

    if not walk(cache, 0):
        return None
    return sum(min(sum(found.values()), capacity[storage]) for storage, found in views.items())
