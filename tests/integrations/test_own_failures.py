"""Issue 20: the profiler's own work is never the reason a run ends, in a real lightning.Trainer and a
real transformers.Trainer.

Each case breaks one piece of the profiler's own work (a destination that cannot be written, a batch
whose size cannot be found, a formula that raises, the report renderer, the cross-rank gather, a full
disk): the run trains to ``max_steps``, one warning names the cause, nothing of the profiler stays on
torch or the model, and the metrics that could still be computed are logged. The user's exceptions on
the same paths (``batch_size_fn``, a logger, the forward) still reach the caller unchanged.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from transformers import BatchEncoding, Trainer, TrainerCallback

from flops_callbacks import guard, register_formula
from flops_callbacks import metrics as names
from flops_callbacks.integrations.hf import HFFlopsCallback
from flops_callbacks.integrations.lightning import FlopsProfilerCallback
from flops_callbacks.integrations.step_profiler import StepProfiler
from flops_callbacks.session.step_session import StepSession
from tests.support import hf_arguments, leftovers, lightning_settings, window_end

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4
PROFILE_STEP, CLEAN = 1, 1
MAX_STEPS = window_end(PROFILE_STEP, CLEAN) + 2  # the window, then two metered steps
FRAMEWORKS = ["lightning", "hf"]
# by hand: Linear(8, 16) + ReLU + Linear(16, 4) on 4 samples (bias adds fused, ReLU one per element),
# then the MSE loss in the model's forward (3 per element: subtract, square, mean)
FWD_FLOPS = 2 * BATCH * IN * HIDDEN + BATCH * HIDDEN + 2 * BATCH * HIDDEN * OUT + 3 * BATCH * OUT


# --- batches of every kind -------------------------------------------------------------------------------


class TrainerBatch:
    """What the HF Trainer asks of a batch that is not a mapping: ``len(batch)``, ``"labels" in batch``."""

    def __len__(self) -> int:
        return 2

    def __contains__(self, key: str) -> bool:
        return False


@dataclasses.dataclass
class DataBatch(TrainerBatch):
    x: torch.Tensor
    y: torch.Tensor


@attrs.define
class AttrsBatch(TrainerBatch):
    x: torch.Tensor
    y: torch.Tensor


class ObjectBatch(TrainerBatch):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "dict": lambda x, y: {"x": x, "labels": y},
    "BatchEncoding": lambda x, y: BatchEncoding({"x": x, "labels": y}),
    "dataclass": DataBatch,
    "attrs": AttrsBatch,
    "object": ObjectBatch,
    "no tensor": lambda x, y: {"x": x.tolist(), "labels": y.tolist()},
}


def unpack(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, (dict, BatchEncoding)):
        return torch.as_tensor(batch["x"]), torch.as_tensor(batch["labels"])
    return batch.x, batch.y


def collate(kind: str) -> Callable[[list[tuple[torch.Tensor, torch.Tensor]]], Any]:
    def collate_fn(samples: list[Any]) -> Any:
        if isinstance(samples[0], dict):
            samples = [(s["x"], s["labels"]) for s in samples]
        return KINDS[kind](torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))

    return collate_fn


def data(size: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(size, IN, generator=generator), torch.randn(size, OUT, generator=generator)
    return list(zip(x, y, strict=True))


# --- a formula that fails ------------------------------------------------------------------------------


@torch.library.custom_op("flops_test_own::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


scale.register_fake(lambda x: torch.empty_like(x))
scale.register_autograd(lambda ctx, grad: grad * 2)


@register_formula(torch.ops.flops_test_own.scale, kind="elementwise")
def broken_formula(args: tuple, kwargs: dict, out: Any) -> int:
    raise ArithmeticError("the formula broke")


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(x)


# --- the two frameworks --------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        layers = [nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)]
        self.layers = nn.Sequential(*layers, *([Scale()] if broken else []))
        self.error: BaseException | None = None  # raised by the forward of the counting step
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.error is not None and self.calls == PROFILE_STEP + 1:
            raise self.error
        out = self.layers(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class LitNet(L.LightningModule):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(*unpack(batch))["loss"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class BatchTrainer(Trainer):
    """A Trainer for batches the model does not take as keywords (a user's own compute_loss)."""

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        out = model(*unpack(inputs))
        return (out["loss"], out) if return_outputs else out["loss"]


class RaisingCSVLogger(CSVLogger):
    def __init__(self, root: Path, error: BaseException) -> None:
        super().__init__(root)
        self.error = error

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if names.FWD_FLOPS in metrics:
            raise self.error
        super().log_metrics(metrics, step)


class RaisingOnLog(TrainerCallback):
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and any(names.FWD_FLOPS in key for key in logs):
            raise self.error


@dataclasses.dataclass
class Run:
    """What a run left: its callback, the steps it trained, the metrics its loggers got, its warnings."""

    callback: Any
    steps: int
    metrics: list[dict[str, float]]
    warnings: list[str]
    log_dir: Path


def run(
    framework: str,
    tmp_path: Path,
    kind: str = "dict",
    net: Net | None = None,
    log_dir: Path | None = None,
    raising_logger: BaseException | None = None,
    **options: Any,
) -> Run:
    """Train ``net`` for MAX_STEPS with the framework's callback (``options``), checking that nothing of
    the profiler stays on torch or the model."""
    net = net or Net()
    log_dir = log_dir or tmp_path / "logs"
    options = {"profile_step": PROFILE_STEP, "clean_steps": CLEAN, "print_profile": False, **options}
    before = leftovers(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if framework == "lightning":
            callback: Any = FlopsProfilerCallback(**options)
            module = LitNet(net)
            if raising_logger is not None:
                logger: Any = RaisingCSVLogger(log_dir, raising_logger)
            else:
                logger = CSVLogger(log_dir) if log_dir.parent.is_dir() else False
            trainer = L.Trainer(callbacks=[callback], **lightning_settings(log_dir, MAX_STEPS, logger=logger))
            loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, collate_fn=collate(kind))
            trainer.fit(module, loader)
            steps = trainer.global_step
            metrics = _csv_rows(Path(logger.log_dir)) if logger else []
        else:
            callback = HFFlopsCallback(**options)
            args = hf_arguments(log_dir, MAX_STEPS, BATCH, remove_unused_columns=False)
            extra = [RaisingOnLog(raising_logger)] if raising_logger is not None else []
            trainer = BatchTrainer(
                model=net, args=args, train_dataset=data(), data_collator=collate(kind),
                callbacks=[callback, *extra],
            )  # fmt: skip
            trainer.train()
            steps = trainer.state.global_step
            metrics = list(trainer.state.log_history)
    assert leftovers(net) == before
    said = [str(w.message) for w in caught if str(w.message).startswith(type(callback).__name__)]
    return Run(callback, steps, metrics, said, log_dir)


def _csv_rows(log_dir: Path) -> list[dict[str, float]]:
    path = log_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def logged(run: Run, name: str) -> list[float]:
    """Every value of a metric the run's loggers got (the HF Trainer logs ours under their own names)."""
    return [row[name] for row in run.metrics if name in row]


# --- destinations that cannot be written ---------------------------------------------------------------


@pytest.fixture
def regular_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    yield path


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("where", ["under a regular file", "under /proc", "under /sys"])
def test_an_output_file_that_cannot_be_written_is_said_at_the_start_and_the_run_goes_on(
    tmp_path: Path, regular_file: Path, framework: str, where: str, capsys: pytest.CaptureFixture
) -> None:
    parent = {
        "under a regular file": regular_file,
        "under /proc": Path("/proc/flops"),
        "under /sys": Path("/sys/flops"),
    }
    output_file = parent[where] / "report.txt"
    done = run(framework, tmp_path, output_file=output_file)
    assert done.steps == MAX_STEPS
    (warning,) = done.warnings
    assert f"cannot write output_file {output_file}: " in warning and "Training goes on" in warning
    assert logged(done, names.FWD_FLOPS) == [FWD_FLOPS]
    assert len(logged(done, names.THROUGHPUT_SAMPLES_PER_SEC)) == 2  # metering goes on after the window
    printed = capsys.readouterr().out  # the full report the file would have held, printed instead
    assert "Profile Summary at step 1" in printed and "Detailed Profile per GPU" in printed
    assert not output_file.exists()


def test_a_log_dir_that_cannot_be_written_is_said_at_the_start_and_the_run_goes_on(
    tmp_path: Path, regular_file: Path
) -> None:
    """Lightning with ``logger=False`` writes nothing itself: only the profiler would. (The HF Trainer
    creates its ``output_dir``, our log dir, in its constructor: one it cannot make stops it there.)"""
    done = run("lightning", tmp_path, log_dir=regular_file / "logs")
    assert done.steps == MAX_STEPS
    (warning,) = done.warnings
    assert f"cannot write log_dir {regular_file / 'logs'}: {regular_file} is not a folder" in warning
    assert done.callback.result.metrics()[names.FWD_FLOPS] == FWD_FLOPS  # the profile is there


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_full_disk_at_the_window_end_is_said_once_and_the_metrics_are_logged(
    tmp_path: Path, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(path: Any, text: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("flops_callbacks.reporting.publish.write_text", full_disk)
    done = run(framework, tmp_path)
    assert done.steps == MAX_STEPS
    (warning,) = done.warnings
    assert "writing the profile's files failed (OSError: [Errno 28] No space left on device" in warning
    assert "flops_profile_step1.json" in warning and "flops_profile_step1.html" in warning
    assert logged(done, names.FWD_FLOPS) == [FWD_FLOPS]


# --- batches -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kind", ["BatchEncoding", "dataclass", "attrs", "object"])
def test_batches_in_any_container_are_profiled_with_their_size(
    tmp_path: Path, framework: str, kind: str
) -> None:
    done = run(framework, tmp_path, kind=kind)
    assert done.steps == MAX_STEPS and done.warnings == []
    assert done.callback.result.samples == BATCH
    assert logged(done, names.FWD_FLOPS) == [FWD_FLOPS]
    assert len(logged(done, names.SAMPLES_PER_SEC)) == 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_batch_with_no_tensor_says_so_once_and_reports_samples_per_second_as_na(
    tmp_path: Path, framework: str
) -> None:
    done = run(framework, tmp_path, kind="no tensor")
    assert done.steps == MAX_STEPS
    (warning,) = done.warnings
    assert "cannot find the batch size of a dict batch" in warning
    assert "batch_size_fn" in warning and "tokens_fn" in warning
    assert logged(done, names.FWD_FLOPS) == [FWD_FLOPS]  # the flops are counted all the same
    assert logged(done, names.SAMPLES_PER_SEC) == []
    text = _report(done)
    assert "n/a: the batch size was not found (pass batch_size_fn)" in text


def _report(done: Run) -> str:
    (path,) = done.log_dir.rglob("flops_profile_step1.txt")
    return path.read_text()


# --- the profiler's own computations -------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_formula_that_raises_drops_the_window_and_the_run_goes_on_unprofiled(
    tmp_path: Path, framework: str
) -> None:
    done = run(framework, tmp_path, net=Net(broken=True))
    assert done.steps == MAX_STEPS
    (warning,) = done.warnings
    assert "counting flops_test_own.scale.default with its formula failed" in warning
    assert "ArithmeticError: the formula broke" in warning and "goes on unprofiled" in warning
    assert done.callback.result is None
    assert logged(done, names.FWD_FLOPS) == [] and logged(done, names.THROUGHPUT_SAMPLES_PER_SEC) == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_failing_report_renderer_is_said_once_and_the_metrics_json_and_picture_still_go_out(
    tmp_path: Path, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> str:
        raise KeyError("renderer")

    monkeypatch.setattr("flops_callbacks.reporting.window_rows.render_profile", broken)
    done = run(framework, tmp_path)
    assert done.steps == MAX_STEPS
    (warning,) = done.warnings
    assert "rendering the report failed (KeyError: 'renderer')" in warning
    assert logged(done, names.FWD_FLOPS) == [FWD_FLOPS]
    written = sorted(p.name for p in done.log_dir.rglob("flops_profile_step1*"))
    assert written == [
        "flops_profile_step1.html",
        "flops_profile_step1.json",
        "flops_profile_step1.trace.json",
    ]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_failing_exchange_between_ranks_drops_the_window_with_one_warning_and_training_goes_on(
    tmp_path: Path, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flops_callbacks.session.ranks import RankFailure, Ranks

    def broken(self: Ranks, mine: Any) -> list[Any]:
        raise RankFailure("RuntimeError: gloo: connection reset")

    monkeypatch.setattr(Ranks, "gather", broken)  # the votes'
    monkeypatch.setattr(Ranks, "exchange", broken)  # the rows' at the window's end
    done = run(framework, tmp_path)
    assert done.steps == MAX_STEPS
    (warning,) = done.warnings
    assert "the ranks' vote failed (RuntimeError: gloo: connection reset)" in warning
    assert "the profile window is dropped" in warning and "on every rank" in warning
    assert logged(done, names.FWD_FLOPS) == [] and logged(done, names.ITER_LATENCY) == []


# --- the user's exceptions on the same paths -----------------------------------------------------------


class UserError(Exception):
    pass


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("point", ["batch_size_fn", "logger", "forward"])
def test_the_users_exceptions_on_the_same_paths_propagate_unchanged(
    tmp_path: Path, framework: str, point: str
) -> None:
    error = UserError(point)
    net, kwargs = Net(), {}
    if point == "batch_size_fn":

        def batch_size_fn(batch: Any) -> int:
            raise error

        kwargs["batch_size_fn"] = batch_size_fn
    elif point == "logger":
        kwargs["raising_logger"] = error
    else:
        net.error = error
    with pytest.raises(UserError) as raised:
        run(framework, tmp_path, kind="dataclass", net=net, **kwargs)
    assert raised.value is error


@pytest.mark.parametrize("framework", [*FRAMEWORKS, "loop"])
def test_a_failure_of_our_close_under_the_users_error_is_said_and_the_users_error_passes(
    tmp_path: Path, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window is closed as the user's error passes; where that close fails (here after its work,
    so nothing stays), the user's error still reaches the caller, and the failure is one warning."""
    close = StepSession.close

    def failing_close(self: StepSession, *args: Any, **kwargs: Any) -> None:
        close(self, *args, **kwargs)
        if sys.exc_info()[1] is not None:  # the user's error on its way out
            raise ArithmeticError("our close broke")

    said: list[str] = []
    monkeypatch.setattr(StepSession, "close", failing_close)
    monkeypatch.setattr(guard, "warn", said.append)  # run() keeps the warnings it catches to itself
    error, net = UserError("forward"), Net()
    net.error = error
    with pytest.raises(UserError) as raised:
        if framework == "loop":
            before = leftovers(net)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
            with StepProfiler(net, profile_step=PROFILE_STEP, clean_steps=CLEAN, print_profile=False) as prof:
                for x, y in data()[: MAX_STEPS * BATCH : BATCH]:
                    with prof.step(x):
                        net(x[None], y[None])["loss"].backward()
                        optimizer.step()
                        optimizer.zero_grad()
        else:
            run(framework, tmp_path, kind="dataclass", net=net)
    assert raised.value is error
    owner = {"lightning": "FlopsProfilerCallback", "hf": "HFFlopsCallback", "loop": "StepProfiler"}[framework]
    failed = (
        f"{owner}: closing the profile window failed (ArithmeticError: our close broke); your error follows."
    )
    assert said and set(said) == {failed}
    if framework == "loop":
        assert leftovers(net) == before
