"""The profiler's only collectives: what every rank of a multi-process run tells the others.

A window shaped by each rank alone ends on different steps when ranks see other batch shapes, and a
profiler collective then meets a framework's (a hang under Lightning, a gloo mismatch under the HF
Trainer). So every collective of the package goes through :class:`Ranks`, on a gloo process group of
its own (made at a run's start by every rank, once per default group and shared by every profiler of the
process: one gloo group holds threads and sockets; it never queues behind the training's NCCL work and
never pairs with a framework's collective) with a timeout on every wait. The callers reach it
only at points every rank reaches in lock step (:mod:`flops_callbacks.session.window_plan`).

Every collective opens with one tensor all-gather of :data:`ROW` floats that names what each rank is at
(a vote, the window's end, the throughput's exchange): a rank whose loop ended early (uneven inputs under
DDP's ``join()``) and closes while another votes meets that vote in a collective of the same size, and
every rank sees the two differ and stops the profiler's collectives for the run, where an object exchange
meeting a vote was a gloo size mismatch that aborted the process.

Why ``all_gather_object`` for the rows at a window's end: they are a few small tuples per window step
(Python ints stay exact past 2**53 flops), and every rank then decides from the same list. Why a tensor
all-gather for the votes (:meth:`Ranks.gather`): a vote is a handful of flags and seconds, twice a clean
step, and ``all_gather_object`` pickles and runs two collectives (the sizes, then the bytes): on two
ranks of a shared 2-core machine a vote took about 2 ms that way against 0.5 ms as one tensor.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["RANK_TIMEOUT", "ROW", "RankFailure", "Ranks"]

RANK_TIMEOUT = 300.0  # seconds a profiler collective may wait for the slowest rank
ROW = 64  # floats every rank gives in a collective's first all-gather: what it is at, and a vote's numbers
# what a rank is at in a collective, by the code its row opens with
_AT = ("a vote", "the window's end", "the throughput's exchange")
# the profiler's process groups: by the default group's id and the timeout, (that default group, ours).
# Every profiler of the process shares one (each making its own leaked a gloo group, 5 sockets and 3
# threads, per callback or StepProfiler made); one whose collective failed is made anew by the next run.
_GROUPS: dict[tuple[int, float], tuple[Any, Any]] = {}


class RankFailure(RuntimeError):
    """A profiler collective failed or timed out: the window is dropped on every rank."""


class Ranks:
    """This process's place among the run's ranks and the profiler's own process group (module doc).

    Without torch.distributed, or with one process, :meth:`exchange` returns ``[mine]`` and costs nothing.
    Pickles without its group (Lightning's ``ddp_spawn`` pickles the callbacks): :meth:`setup` makes it.

    Args:
        timeout: seconds a collective may wait for the other ranks.
    """

    def __init__(self, timeout: float = RANK_TIMEOUT) -> None:
        self.timeout = timeout
        self._group: Any = None
        self._default: Any = None  # the default group the profiler's was made beside
        self._lost = ""  # why the profiler's collectives stopped for the run ("": they did not)
        self.world = 1
        self.rank = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["timeout"])  # type: ignore[misc]

    def setup(self) -> None:
        """At a run's start, on every rank: the profiler's process group (once per default group)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            self._group, self._default, self.world, self.rank = None, None, 1, 0
            return
        default = dist.group.WORLD
        if self._group is None or self._default is not default:
            self._group, self._lost = None, ""
            self._default = default
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            key = (id(default), self.timeout)
            made = _GROUPS.get(key)
            if made is None or made[0] is not default:  # (an id reused by a default group made anew)
                timeout = datetime.timedelta(seconds=self.timeout)
                made = _GROUPS[key] = (default, dist.new_group(backend="gloo", timeout=timeout))
            self._group = made[1]

    def _forget_group(self) -> None:
        """The group failed: never waited on again in this run, and made anew by the next run's start."""
        group, self._group = self._group, None
        for key, (_, shared) in list(_GROUPS.items()):
            if shared is group:
                del _GROUPS[key]

    @property
    def several(self) -> bool:
        return self.world > 1

    def exchange(self, mine: Any, throughput: bool = False) -> list[Any]:
        """Every rank's ``mine``, by rank (every rank must call this at the same point: the window's end,
        or with ``throughput`` the throughput's exchange); raises :class:`RankFailure` when a rank does
        not answer within the timeout, is at another collective of the profiler's, or the group fails.

        Args:
            mine: this rank's row (small, picklable).
            throughput: the throughput's exchange (else the window's end).
        """
        if self.world < 2:
            return [mine]
        self._rows(2 if throughput else 1, ())
        every: list[Any] = [None] * self.world
        self._collective(lambda group: torch.distributed.all_gather_object(every, mine, group=group))
        return every

    def gather(self, mine: Sequence[float]) -> list[tuple[float, ...]]:
        """Every rank's vote ``mine`` (the same length on every rank, under :data:`ROW`), by rank, in one
        collective of float64s (module doc); raises :class:`RankFailure` as :meth:`exchange` does.

        Args:
            mine: this rank's numbers.
        """
        if self.world < 2:
            return [tuple(mine)]
        return [row[: len(mine)] for row in self._rows(0, mine)]

    def _rows(self, at: int, numbers: Sequence[float]) -> list[tuple[float, ...]]:
        """Every rank's ``numbers`` after the code of what it is at (:data:`_AT`), in one all-gather of
        :data:`ROW` floats; :class:`RankFailure` on every rank where the ranks are at different points."""
        if len(numbers) >= ROW:
            raise ValueError(f"a vote of {len(numbers)} numbers: at most {ROW - 1} fit a row")
        row = torch.full((ROW,), math.nan, dtype=torch.float64)
        row[0] = at
        row[1 : 1 + len(numbers)] = torch.tensor(numbers, dtype=torch.float64)
        every = [torch.empty_like(row) for _ in range(self.world)]
        self._collective(lambda group: torch.distributed.all_gather(every, row, group=group))
        codes = [int(t[0]) for t in every]
        if len(set(codes)) > 1:  # every rank sees the same rows: every rank stops here
            where = ", ".join(f"rank {rank} at {_AT[code]}" for rank, code in enumerate(codes))
            self._forget_group()
            self._lost = f"the ranks reached different points ({where}: a rank's loop ended early?)"
            raise RankFailure(self._lost)
        return [tuple(t[1:].tolist()) for t in every]

    def _collective(self, call: Callable[[Any], object]) -> None:
        """``call(group)`` on the profiler's group; a failure becomes :class:`RankFailure`, and the group
        is never waited on again in this run."""
        if self._group is None:
            raise RankFailure(
                f"the profiler's collectives stopped earlier: {self._lost}"
                if self._lost
                else "the profiler's process group could not be made at the run's start"
            )
        try:
            call(self._group)
        except Exception as error:  # gloo raises RuntimeError (timeouts, closed peers) and others
            self._forget_group()
            self._lost = f"{type(error).__name__}: {error}"
            raise RankFailure(self._lost) from error
