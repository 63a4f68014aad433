"""StepPhases: contiguous phases of one step, and held-open gaps given to the phase the next event reveals."""

from __future__ import annotations

import pytest

from flops_callbacks.phase_names import BACKWARD, FORWARD, OPTIMIZER_STEP
from flops_callbacks.timing.phases import StepPhases


class TickClock:
    """Marks are 0, 1, 2, ...: every mark is one second after the previous one."""

    def __init__(self) -> None:
        self.now = -1

    def mark(self) -> int:
        self.now += 1
        return self.now

    def seconds(self, start: int, end: int) -> float:
        return float(end - start)

    def synchronize(self) -> None:
        pass

    def done(self, mark: object) -> bool:
        return True


def test_contiguous_phases_cover_every_second_between_the_first_and_last_mark() -> None:
    phases = StepPhases(TickClock())
    phases.start(FORWARD)  # 0
    phases.start(BACKWARD)  # 1
    phases.start(OPTIMIZER_STEP)  # 2
    phases.stop()  # 3
    assert phases.seconds() == (1.0, 1.0, 1.0)


def test_a_gap_before_a_backward_was_a_forward_a_gans_second_model() -> None:
    phases = StepPhases(TickClock())
    phases.start(FORWARD)  # 0: generator forward
    phases.start(BACKWARD)  # 1
    phases.start(OPTIMIZER_STEP)  # 2
    phases.end()  # 3: the generator's optimizer.step() returned
    phases.start(BACKWARD)  # 4: the discriminator's backward: 3..4 was its forward
    phases.start(OPTIMIZER_STEP)  # 5
    phases.end()  # 6
    phases.stop()  # 7: the end of training_step continues the optimizer step
    assert phases.seconds() == (1.0 + 1.0, 1.0 + 1.0, 1.0 + 1.0 + 1.0)


def test_a_gap_after_a_backward_continues_it_unless_another_backward_follows() -> None:
    phases = StepPhases(TickClock())
    phases.start(FORWARD)  # 0
    phases.start(BACKWARD)  # 1
    phases.end()  # 2: on_after_backward
    phases.start(BACKWARD)  # 3: a second manual chunk: 2..3 was its forward
    phases.end()  # 4
    phases.start(OPTIMIZER_STEP)  # 5: 4..5 is still backward (unscale, clipping)
    phases.stop()  # 6
    assert phases.seconds() == (1.0 + 1.0, 1.0 + 1.0 + 1.0, 1.0)


def test_stop_between_micro_batches_leaves_the_gap_untimed() -> None:
    clock = TickClock()
    phases = StepPhases(clock)
    phases.start(FORWARD)  # 0
    phases.start(BACKWARD)  # 1
    phases.stop()  # 2
    clock.mark()  # 3: a validation run between micro-batches
    phases.start(FORWARD)  # 4
    phases.start(BACKWARD)  # 5
    phases.start(OPTIMIZER_STEP)  # 6
    phases.stop()  # 7
    assert phases.seconds() == (2.0, 2.0, 1.0)


def test_an_unknown_phase_name_is_refused() -> None:
    with pytest.raises(ValueError, match="phase must be one of"):
        StepPhases(TickClock()).start("warmup")


def test_a_restarted_forward_drops_the_frameworks_work_before_it_and_a_stop_the_work_after_it() -> None:
    phases = StepPhases(TickClock())
    phases.start(FORWARD)  # 0: the micro-batch starts (the step's first mark: the data wait ends here)
    assert phases.restart(FORWARD)  # 1: the user's training_step starts: 0..1 is no phase's
    phases.stop()  # 2: it returned; zero_grad runs
    phases.start(BACKWARD)  # 3: 2..3 is no phase's
    assert not phases.restart(FORWARD)  # a backward runs: nothing to restart
    phases.start(OPTIMIZER_STEP)  # 4
    phases.stop()  # 5
    assert phases.seconds() == (1.0, 1.0, 1.0) and phases.first_mark == 0
