"""FlopsProfilerCallback in a real lightning.Trainer on CPU: what lands in real logger files, and what
does not stay behind.

The model is Linear(8, 16) -> ReLU -> Linear(16, 4) with the loss computed in ``training_step``
(outside the model's modules), so its flops can be counted by hand below.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint

from flops_callbacks import metrics as names
from flops_callbacks.lightning import FlopsProfilerCallback

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 3
PROFILE_STEP = 2
PARAMS = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT


# --- flops of one micro-batch, by hand ------------------------------------------------------------
# Linear is one addmm: 2 * batch * in * out flops (the bias add is part of the addmm, not counted apart,
# as in FlopCounterMode). Elementwise ops count 1 flop per output element; a bias gradient is a sum
# over the batch: 1 flop per element of the summed gradient.


def block_fwd_flops(batch: int) -> int:
    """Linear(IN, HIDDEN) + ReLU."""
    return 2 * batch * IN * HIDDEN + batch * HIDDEN


def fwd_flops(batch: int) -> int:
    return block_fwd_flops(batch) + 2 * batch * HIDDEN * OUT


def bwd_flops(batch: int) -> int:
    # The input needs no grad, so the first Linear computes no input gradient: bwd is not 2 x fwd.
    head = 2 * batch * OUT * HIDDEN + 2 * batch * OUT * HIDDEN + batch * OUT  # grad input, weight, bias
    relu = batch * HIDDEN  # threshold_backward
    first = 2 * batch * IN * HIDDEN + batch * HIDDEN  # grad weight, bias
    return head + relu + first


def fwd_macs(batch: int) -> int:
    return batch * IN * HIDDEN + batch * HIDDEN * OUT


# --- the Lightning side ---------------------------------------------------------------------------


class MLP(L.LightningModule):
    def __init__(self, manual: bool = False, checkpointed: bool = False, fail_in: str | None = None) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, OUT)
        self.automatic_optimization = not manual
        self.checkpointed = checkpointed
        self.fail_in = fail_in  # "forward" or "backward": raise during the profiled step
        self.error = RuntimeError("boom in the profiled step")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        failing = self.trainer.global_step == PROFILE_STEP and self.fail_in is not None
        if failing and self.fail_in == "forward":
            raise self.error
        x, y = batch
        h = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        if failing and self.fail_in == "backward":
            h.register_hook(self._raise)
        loss = F.mse_loss(self.head(h), y)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def _raise(self, grad: torch.Tensor) -> None:
        raise self.error

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ValidatedMLP(MLP):
    """Validates after every training batch and records when, to prove where validation ran."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self.events.append(("train", self.trainer.global_step))

    def on_validation_start(self) -> None:
        self.events.append(("validation", self.trainer.global_step))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.head(self.block(x)), y))


def loader(samples: int = 48) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, IN, generator=generator), torch.randn(samples, OUT, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    return batch[0].numel()  # say each input feature is a token


def fit(
    root: Path, module: L.LightningModule, callback: FlopsProfilerCallback | None, **options: object
) -> L.Trainer:
    settings: dict = dict(
        accelerator="cpu",
        devices=1,
        max_steps=PROFILE_STEP + 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=root,
    )
    ckpt_path = options.pop("ckpt_path", None)
    settings.update(options)
    trainer = L.Trainer(callbacks=[callback] if callback else [], **settings)
    val = loader(6) if isinstance(module, ValidatedMLP) else None
    trainer.fit(module, train_dataloaders=loader(), val_dataloaders=val, ckpt_path=ckpt_path)
    return trainer


def quiet_callback(**kwargs: object) -> FlopsProfilerCallback:
    return FlopsProfilerCallback(profile_step=PROFILE_STEP, print_profile=False, **kwargs)


def csv_metrics(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def logged_once(rows: list[dict[str, str]], with_tokens: bool = False) -> dict[str, float]:
    """Each flops_profiler/* value of a CSV log, asserting it was logged exactly once, at PROFILE_STEP
    (tokens_per_sec only when the callback has a tokens_fn)."""
    values = {}
    for name in names.ALL:
        logged = [row for row in rows if row.get(name)]
        if name == names.TOKENS_PER_SEC and not with_tokens:
            assert logged == []
            continue
        assert len(logged) == 1, name
        assert int(logged[0]["step"]) == PROFILE_STEP, name
        values[name] = float(logged[0][name])
    return values


# --- what must not stay behind --------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
)


def model_state(model: nn.Module) -> dict:
    """Every hook and attribute name of every module, and torch's global module hooks."""
    state = {
        (name, attr): dict(getattr(module, attr))
        for name, module in model.named_modules()
        for attr in _HOOK_DICTS
    }
    # attribute names of the submodules (Lightning itself adds some to the LightningModule during fit)
    state.update({(name, "attributes"): set(vars(module)) for name, module in model.named_modules() if name})
    state.update({attr: dict(getattr(torch.nn.modules.module, attr)) for attr in _GLOBAL_HOOKS})
    return state


def torch_namespace() -> dict:
    return {(ns.__name__, key): value for ns in (torch, F, torch.Tensor) for key, value in vars(ns).items()}


def assert_nothing_left(model: nn.Module, before_model: dict, before_torch: dict) -> None:
    assert model_state(model) == before_model
    after_torch = torch_namespace()
    changed = [key for key, value in before_torch.items() if after_torch.get(key) is not value]
    assert changed == []
    assert _get_current_dispatch_mode_stack() == []
    assert _get_current_function_mode_stack() == []


# --- one run with TensorBoard and CSV loggers, read back -------------------------------------------


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("logged_run")
    module = MLP()
    callback = FlopsProfilerCallback(profile_step=PROFILE_STEP, detailed=False, tokens_fn=tokens)
    loggers = [TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")]
    before_model, before_torch = model_state(module), torch_namespace()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        trainer = fit(root, module, callback, logger=loggers)
    return dict(
        trainer=trainer,
        module=module,
        callback=callback,
        loggers=loggers,
        stdout=stdout.getvalue(),
        before_model=before_model,
        before_torch=before_torch,
    )


def test_tensorboard_event_file_has_every_metric_once_at_the_profiled_step(logged_run: dict) -> None:
    events = EventAccumulator(logged_run["loggers"][0].log_dir, size_guidance={"scalars": 0})
    events.Reload()
    values = {}
    for name in names.ALL:
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == [PROFILE_STEP], name
        values[name] = scalars[0].value
    assert values[names.FWD_FLOPS] == fwd_flops(BATCH)
    assert values[names.BWD_FLOPS] == bwd_flops(BATCH)
    assert values[names.BWD_FLOPS] != 2 * values[names.FWD_FLOPS]
    assert values[names.FWD_MACS] == fwd_macs(BATCH)
    assert values[names.PARAMS] == PARAMS
    phases = values[names.FWD_LATENCY] + values[names.BWD_LATENCY] + values[names.STEP_LATENCY]
    assert values[names.ITER_LATENCY] == pytest.approx(phases, rel=1e-6)  # event files hold float32


def test_csv_has_every_metric_once_with_hand_counted_flops(logged_run: dict) -> None:
    values = logged_once(csv_metrics(logged_run["loggers"][1]), with_tokens=True)
    assert values[names.FWD_FLOPS] == fwd_flops(BATCH) == 1200
    assert values[names.BWD_FLOPS] == bwd_flops(BATCH) == 1644
    assert values[names.RECOMPUTE_FLOPS] == 0
    assert values[names.FWD_MACS] == fwd_macs(BATCH)
    assert values[names.PARAMS] == PARAMS
    fwd, bwd, step = (values[n] for n in (names.FWD_LATENCY, names.BWD_LATENCY, names.STEP_LATENCY))
    assert min(fwd, bwd, step) > 0
    iter_latency = values[names.ITER_LATENCY]
    assert iter_latency == fwd + bwd + step
    assert values[names.SAMPLES_PER_SEC] == pytest.approx(BATCH * 1 / iter_latency)  # one device: dp = 1
    assert values[names.TOKENS_PER_SEC] == pytest.approx(BATCH * IN / iter_latency)
    assert values[names.FLOPS_PER_SEC] == pytest.approx((fwd_flops(BATCH) + bwd_flops(BATCH)) / iter_latency)
    assert values[names.FWD_FLOPS_PER_SEC] == pytest.approx(fwd_flops(BATCH) / fwd)
    assert values[names.BWD_FLOPS_PER_SEC] == pytest.approx(bwd_flops(BATCH) / bwd)
    assert values == pytest.approx(logged_run["callback"].result.metrics())


def test_report_is_printed_once_and_saved_with_its_json_next_to_the_logs(logged_run: dict) -> None:
    stdout, trainer = logged_run["stdout"], logged_run["trainer"]
    assert stdout.count(f"Profile Summary at step {PROFILE_STEP}") == 1
    log_dir = Path(trainer.log_dir)
    assert log_dir == Path(logged_run["loggers"][0].log_dir)
    report = (log_dir / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
    assert report.strip() in stdout
    saved = json.loads((log_dir / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    assert saved["step"] == PROFILE_STEP
    assert saved["metrics"] == logged_run["callback"].result.metrics()
    assert saved["profile"]["modules"]["block.0"]["fwd_flops"] == 2 * BATCH * IN * HIDDEN


def test_nothing_stays_on_the_model_or_torch_after_fit(logged_run: dict) -> None:
    assert_nothing_left(logged_run["module"], logged_run["before_model"], logged_run["before_torch"])
    assert not logged_run["callback"].profiler.active


def test_output_file_gets_the_report_instead_of_stdout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    report = tmp_path / "reports" / "flops.txt"
    fit(tmp_path, MLP(), FlopsProfilerCallback(profile_step=PROFILE_STEP, output_file=report))
    assert f"Profile Summary at step {PROFILE_STEP}" in report.read_text()
    assert "Profile Summary" not in capsys.readouterr().out


def test_batch_size_fn_sets_the_samples(tmp_path: Path) -> None:
    callback = quiet_callback(batch_size_fn=lambda batch: 5 * len(batch[0]))
    fit(tmp_path, MLP(), callback)
    result = callback.result
    assert result.samples == 5 * BATCH
    assert result.metrics()[names.SAMPLES_PER_SEC] == pytest.approx(5 * BATCH / result.iter_latency)


# --- the shapes a training step takes ----------------------------------------------------------------


def test_accumulated_micro_batches_are_one_step(tmp_path: Path) -> None:
    callback, logger = quiet_callback(), CSVLogger(tmp_path)
    fit(tmp_path, MLP(), callback, accumulate_grad_batches=2, logger=logger)
    values = logged_once(csv_metrics(logger))
    assert values[names.FWD_FLOPS] == 2 * fwd_flops(BATCH)
    # the second micro-batch's gradients are added into .grad: one flop per trainable parameter
    assert values[names.BWD_FLOPS] == 2 * bwd_flops(BATCH) + PARAMS
    result = callback.result
    assert (result.samples, result.micro_batches) == (2 * BATCH, 2)
    assert values[names.SAMPLES_PER_SEC] == pytest.approx(2 * BATCH / values[names.ITER_LATENCY])


def test_manual_optimization(tmp_path: Path) -> None:
    callback = quiet_callback()
    fit(tmp_path, MLP(manual=True), callback)
    result = callback.result
    assert (result.profile.fwd_flops, result.profile.bwd_flops) == (fwd_flops(BATCH), bwd_flops(BATCH))
    assert result.step == PROFILE_STEP and result.micro_batches == 1
    assert min(result.fwd_latency, result.bwd_latency, result.step_latency) > 0


def test_bf16_mixed_precision_counts_the_same_flops(tmp_path: Path) -> None:
    callback = quiet_callback()
    fit(tmp_path, MLP(), callback, precision="bf16-mixed")
    profile = callback.result.profile
    assert (profile.fwd_flops, profile.bwd_flops) == (fwd_flops(BATCH), bwd_flops(BATCH))
    assert profile.modules["head"].functionals["linear"].fwd_flops == 2 * BATCH * HIDDEN * OUT


def test_activation_checkpointing_recompute_is_reported_apart(tmp_path: Path) -> None:
    callback = quiet_callback()
    fit(tmp_path, MLP(checkpointed=True), callback)
    profile = callback.result.profile
    assert (profile.fwd_flops, profile.bwd_flops) == (fwd_flops(BATCH), bwd_flops(BATCH))
    assert profile.recompute_flops == block_fwd_flops(BATCH)
    assert callback.result.metrics()[names.RECOMPUTE_FLOPS] == block_fwd_flops(BATCH)


def test_validation_between_micro_batches_is_not_counted(tmp_path: Path) -> None:
    callback, module = quiet_callback(), ValidatedMLP()
    fit(
        tmp_path,
        module,
        callback,
        accumulate_grad_batches=2,
        val_check_interval=1,
        check_val_every_n_epoch=None,
    )
    # validation did run inside the profiled step, between its two micro-batches
    start = module.events.index(("train", PROFILE_STEP))
    assert module.events[start : start + 3] == [
        ("train", PROFILE_STEP),
        ("validation", PROFILE_STEP),
        ("train", PROFILE_STEP),
    ]
    profile = callback.result.profile
    assert profile.fwd_flops == 2 * fwd_flops(BATCH)  # as without validation (test above)
    assert profile.bwd_flops == 2 * bwd_flops(BATCH) + PARAMS
    assert profile.modules["head"].calls == 2  # the validation calls are not counted either


# --- other loggers' local files -----------------------------------------------------------------------


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    wandb.teardown()  # wandb keeps the settings of an earlier run in this process
    logger = WandbLogger(save_dir=tmp_path, offline=True, project="flops-callbacks-test")
    fit(tmp_path, MLP(), quiet_callback(tokens_fn=tokens), logger=logger)
    logger.experiment.finish()
    wandb.teardown()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's own reader of its transaction log
    wandb_cli = Path(sys.executable).with_name("wandb")
    lines = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    history = [record["history"]["item"] for record in map(json.loads, lines) if record["type"] == "history"]
    for name in names.ALL:
        rows = [row for row in history if name in row]
        assert len(rows) == 1, name
        assert rows[0]["trainer/global_step"] == PROFILE_STEP
    (ours,) = [row for row in history if names.FWD_FLOPS in row]
    assert (ours[names.FWD_FLOPS], ours[names.BWD_FLOPS]) == (fwd_flops(BATCH), bwd_flops(BATCH))


def test_mlflow_file_store_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store opt-in
    logger = MLFlowLogger(experiment_name="flops", tracking_uri=f"file:{tmp_path}/mlruns")
    fit(tmp_path, MLP(), quiet_callback(tokens_fn=tokens), logger=logger)
    metrics_dir = tmp_path / "mlruns" / logger.experiment_id / logger.run_id / "metrics"
    values = {}
    for name in names.ALL:
        lines = (metrics_dir / name).read_text().splitlines()  # "timestamp value step" per logged value
        assert len(lines) == 1, name
        _, value, step = lines[0].split()
        assert int(step) == PROFILE_STEP
        values[name] = float(value)
    assert (values[names.FWD_FLOPS], values[names.BWD_FLOPS]) == (fwd_flops(BATCH), bwd_flops(BATCH))


# --- data parallel: sizes from the strategy, only rank 0 reports ---------------------------------------


def test_ddp_two_processes_rank_zero_reports_with_data_parallel_size(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    callback = FlopsProfilerCallback(profile_step=PROFILE_STEP, detailed=False)
    logger = CSVLogger(tmp_path, version=0)  # the version the spawned rank 0 writes to
    fit(tmp_path, MLP(), callback, devices=2, strategy="ddp_spawn", logger=logger)
    assert capfd.readouterr().out.count(f"Profile Summary at step {PROFILE_STEP}") == 1
    values = logged_once(csv_metrics(logger))
    # Lightning runs training_step through the LightningModule's forward when a strategy wraps the model,
    # so the loss is in the model's counts here: MSE is 3 flops per element forward, 2 backward. DDP
    # divides every gradient by the world size in the backward: 1 flop per parameter.
    assert values[names.FWD_FLOPS] == fwd_flops(BATCH) + 3 * BATCH * OUT
    assert values[names.BWD_FLOPS] == bwd_flops(BATCH) + 2 * BATCH * OUT + PARAMS
    assert values[names.SAMPLES_PER_SEC] == pytest.approx(BATCH * 2 / values[names.ITER_LATENCY])
    saved = json.loads((Path(logger.log_dir) / f"flops_profile_step{PROFILE_STEP}.json").read_text())
    assert saved["metrics"] == pytest.approx(values)
    report = (Path(logger.log_dir) / f"flops_profile_step{PROFILE_STEP}.txt").read_text()
    assert "world size:" in report and "data parallel size:" in report
    for label in ("world size:", "data parallel size:"):
        (line,) = [line for line in report.splitlines() if line.startswith(label)]
        assert line.split()[-1] == "2"


# --- failures and the edges of a run ------------------------------------------------------------------


@pytest.mark.parametrize("fail_in", ["forward", "backward"])
def test_exception_in_the_profiled_step_propagates_and_leaves_nothing(tmp_path: Path, fail_in: str) -> None:
    module, callback = MLP(fail_in=fail_in), quiet_callback()
    before_model, before_torch = model_state(module), torch_namespace()
    with pytest.raises(RuntimeError) as raised:
        fit(tmp_path, module, callback)
    assert raised.value is module.error
    assert_nothing_left(module, before_model, before_torch)
    assert callback.result is None and not callback.profiler.active
    assert list(tmp_path.rglob("flops_profile_step*")) == []


def test_profile_step_beyond_the_run_warns_at_fit_end(tmp_path: Path) -> None:
    callback = FlopsProfilerCallback(profile_step=50)
    with pytest.warns(
        UserWarning, match=r"profile_step=50 \(training ended at global step 4\): no profile ran"
    ):
        fit(tmp_path, MLP(), callback)
    assert callback.result is None


@contextlib.contextmanager
def lightning_log(caplog: pytest.LogCaptureFixture):
    # Lightning's logger does not propagate to the root logger that caplog listens on.
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        lightning_logger.removeHandler(caplog.handler)


def test_resume_past_an_unprofiled_profile_step_says_no_profile_runs(tmp_path: Path) -> None:
    trainer = fit(tmp_path, MLP(), None, max_steps=3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    callback = quiet_callback()
    with pytest.warns(
        UserWarning, match=f"resumed at step 3, past profile_step={PROFILE_STEP}: no profile runs"
    ):
        trainer = fit(tmp_path, MLP(), callback, max_steps=5, ckpt_path=tmp_path / "step3.ckpt")
    assert trainer.global_step == 5 and callback.result is None


def test_resume_after_the_profiled_step_says_it_ran_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder
) -> None:
    first = quiet_callback()
    trainer = fit(tmp_path, MLP(), first, max_steps=3)
    assert first.result is not None
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    callback = quiet_callback()
    with lightning_log(caplog):
        trainer = fit(tmp_path, MLP(), callback, max_steps=5, ckpt_path=tmp_path / "step3.ckpt")
    assert f"step {PROFILE_STEP} was profiled before the checkpoint" in caplog.text
    assert "No profile runs in this run" in caplog.text
    assert trainer.global_step == 5 and callback.result is None
    assert not [w for w in recwarn if "FlopsProfilerCallback" in str(w.message)]


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"profile_step": -1}, "profile_step"),
        ({"profile_step": 2.0}, "profile_step"),
        ({"profile_step": "10"}, "profile_step"),
        ({"profile_step": True}, "profile_step"),
        ({"module_depth": -2}, "module_depth"),
        ({"top_modules": 0}, "top_modules"),
        ({"causal_attention": "quarter"}, "causal_attention"),
        ({"batch_size_fn": 3}, "batch_size_fn"),
        ({"tokens_fn": "tokens"}, "tokens_fn"),
    ],
)
def test_bad_arguments_raise_at_construction_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        FlopsProfilerCallback(**kwargs)


def test_missing_lightning_says_which_extra_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None  # as if Lightning were not installed\n"
        "import flops_callbacks\n"
        "try:\n"
        "    flops_callbacks.FlopsProfilerCallback\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'flops-callbacks[lightning]'" in out
