"""The dense peak table and MFU's inputs: device names as torch reports them, compute dtypes as the
frameworks set them, and the user's overrides."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import numpy
import pytest
import torch
from transformers import TrainingArguments

from flops_callbacks.integrations import hf, lightning
from flops_callbacks.integrations.strategy_state import precision_dtype
from flops_callbacks.options import Options
from flops_callbacks.peaks import (
    BANDWIDTH_ENV_VAR,
    BANDWIDTHS,
    BF16,
    CHIPS,
    ENV_VAR,
    FP8,
    FP16,
    FP32,
    FP64,
    TF32,
    Bandwidth,
    Peak,
    check_peak_flops,
    chip_for,
    fp32_matmul_dtype,
    measured_dtype,
    parameters_dtype,
    resolve_bandwidth,
    resolve_peak,
    table_bandwidth,
    table_peak,
)
from flops_callbacks.session.step_session import StepSession

# (what torch.cuda.get_device_name() returns on that device, our table's name for it)
DEVICE_NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"),
    ("AMD Instinct MI300X", "Instinct MI300X"),
    ("AMD Instinct MI300X VF", "Instinct MI300X"),
    ("AMD Instinct MI325X", "Instinct MI325X"),
    ("AMD Instinct MI355X", "Instinct MI355X"),
]


@pytest.mark.parametrize(("device_name", "chip"), DEVICE_NAMES)
def test_real_device_names_find_their_chip(device_name: str, chip: str) -> None:
    found = chip_for(device_name)
    assert found is not None and found.name == chip


@pytest.mark.parametrize(
    "device_name",
    [
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",  # a seventh of the GPU: the full GPU's peak would be wrong
        "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
        "NVIDIA GeForce RTX 4090 D",  # fewer SMs than the 4090
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA GeForce RTX 3090",
        "NVIDIA H800",
        "Tesla V100-SXM2-32GB",
        "AMD Instinct MI250X",
        "",
    ],
)
def test_unknown_devices_and_mig_slices_have_no_peak(device_name: str) -> None:
    assert chip_for(device_name) is None
    peak, why = table_peak(device_name, BF16)
    assert peak is None and "not in the peak table" in why


# Dense figures as the datasheets print them, independently of the table: "with sparsity" ones halved.
DATASHEET_DENSE_TFLOPS = [
    ("NVIDIA H100 80GB HBM3", BF16, 1979 / 2),
    ("NVIDIA H100 80GB HBM3", FP8, 3958 / 2),
    ("NVIDIA H100 80GB HBM3", TF32, 989 / 2),
    ("NVIDIA H100 PCIe", BF16, 1513 / 2),
    ("NVIDIA H100 NVL", BF16, 1671 / 2),
    ("NVIDIA H200", FP16, 1979 / 2),
    ("NVIDIA A100-SXM4-80GB", BF16, 312),
    ("NVIDIA A100-PCIE-40GB", TF32, 156),
    ("NVIDIA A100-PCIE-40GB", FP32, 19.5),
    ("NVIDIA L4", BF16, 121),
    ("NVIDIA L40S", BF16, 362.05),
    ("NVIDIA GeForce RTX 4090", BF16, 165.2),
    ("NVIDIA B200", BF16, 2250),
    ("NVIDIA GB200", FP8, 5000),
    ("AMD Instinct MI300X", BF16, 1307.4),
    ("AMD Instinct MI355X", FP8, 5033.2),
]


@pytest.mark.parametrize(("device_name", "dtype", "tflops"), DATASHEET_DENSE_TFLOPS)
def test_table_gives_the_dense_datasheet_figure(device_name: str, dtype: str, tflops: float) -> None:
    peak, _ = table_peak(device_name, dtype)
    assert peak is not None
    assert peak.flops == pytest.approx(tflops * 1e12)
    assert f"{dtype} dense" in peak.source


def test_every_entry_has_a_source_and_ordered_dtypes() -> None:
    for chip in CHIPS.values():
        assert chip.source and chip.peaks
        assert all(value > 0 for value in chip.peaks.values())
        # lower precision is never slower on the tensor cores; fp32 (non-tensor) never above tf32
        ordered = [chip.peaks[d] for d in (FP32, TF32, BF16, FP8) if d in chip.peaks]
        assert ordered == sorted(ordered), chip.name
        assert chip.peaks.get(FP16, chip.peaks[BF16]) == chip.peaks[BF16]


def test_tf32_without_tf32_hardware_uses_the_fp32_rate_and_a100_has_no_fp8() -> None:
    peak, _ = table_peak("AMD Instinct MI355X", TF32)
    assert peak is not None and peak.flops == pytest.approx(157.3e12) and "fp32 dense" in peak.source
    peak, why = table_peak("NVIDIA A100-SXM4-80GB", FP8)
    assert peak is None and "no fp8 figure for A100" in why


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_fp32_matmuls_count_as_tf32_only_when_torch_allows_it(restore_matmul_precision: None) -> None:
    torch.set_float32_matmul_precision("highest")
    assert fp32_matmul_dtype() == FP32
    torch.set_float32_matmul_precision("high")
    assert fp32_matmul_dtype() == TF32


def test_on_a_cpu_fp32_matmuls_are_fp32_or_onednns_bf16_never_cudas_tf32(
    restore_matmul_precision: None,
) -> None:
    """The CPU's setting is oneDNN's: "medium" runs fp32 matmuls in bf16 (AMX), "high" at the fp32 rate.
    It read CUDA's, and said tf32 on a CPU."""
    cpu, model = torch.device("cpu"), torch.nn.Linear(2, 2)
    torch.set_float32_matmul_precision("highest")
    assert fp32_matmul_dtype(cpu) == parameters_dtype(model) == FP32
    torch.set_float32_matmul_precision("high")
    assert fp32_matmul_dtype(cpu) == parameters_dtype(model) == FP32 and fp32_matmul_dtype() == TF32
    torch.set_float32_matmul_precision("medium")
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert fp32_matmul_dtype(cpu) == parameters_dtype(model) == BF16


def test_a_float64_model_and_lightnings_64_true_compute_in_fp64() -> None:
    model = torch.nn.Linear(2, 2).double()
    assert parameters_dtype(model) == precision_dtype("64-true", model) == FP64


@pytest.mark.parametrize(
    "value",
    [
        0,
        -1.0,
        "312e12",
        True,
        float("inf"),
        float("nan"),
        [1e12],
        numpy.array([1e12, 2e12]),
        torch.tensor(1e12),
    ],
)
def test_bad_peak_flops_fails_at_construction_naming_the_argument(value: object) -> None:
    with pytest.raises(ValueError, match="peak_flops must be the dense peak FLOPS of one device"):
        Options(peak_flops=value)  # type: ignore[arg-type]


def test_a_numpy_scalar_is_a_number() -> None:
    """numpy's float32 and int64 (a peak read from a table or a config): "must be a positive number"."""
    for value in (numpy.float32(1e12), numpy.int64(10**12)):
        assert Options(peak_flops=value, peak_bandwidth=value).peak_flops == value  # type: ignore[arg-type]
        given = StepSession(Options(peak_flops=value), "test").given_peak  # type: ignore[arg-type]
        assert given == Peak(float(value), "peak_flops argument")


def test_environment_variable_sets_the_peak_and_the_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "312e12")
    assert StepSession(Options(), "test").given_peak == Peak(312e12, f"{ENV_VAR} environment variable")
    assert StepSession(Options(peak_flops=1e12), "test").given_peak == Peak(1e12, "peak_flops argument")
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be the dense peak FLOPS"):
        StepSession(Options(), "test")


def test_no_peak_on_cpu_unless_given() -> None:
    cpu = torch.device("cpu")
    peak, why = resolve_peak(None, cpu, FP32)
    assert peak is None
    how = f"pass peak_flops= (a number, or 'measure') or set {ENV_VAR}"
    assert why == f"no peak FLOPS for a cpu device: {how}"
    given = Peak(5e12, "peak_flops argument")
    assert resolve_peak(given, cpu, FP32) == (given, "")
    assert check_peak_flops(None) is None


# --- peak memory bandwidth ---------------------------------------------------------------------------

# Peak DRAM bandwidth as the datasheets print it (GB/s, decimal), independently of the table.
DATASHEET_GB_PER_SEC = [
    ("NVIDIA H100 80GB HBM3", 3350),
    ("NVIDIA H100 PCIe", 2000),
    ("NVIDIA H100 NVL", 3900),
    ("NVIDIA H200", 4800),
    ("NVIDIA GH200 480GB", 4000),  # 96 GB HBM3
    ("NVIDIA GH200 144G HBM3e", 4900),
    ("NVIDIA A100-SXM4-80GB", 2039),
    ("NVIDIA A100 80GB PCIe", 1935),
    ("NVIDIA A100-SXM4-40GB", 1555),
    ("NVIDIA A100-PCIE-40GB", 1555),
    ("NVIDIA A10G", 600),
    ("NVIDIA L4", 300),
    ("NVIDIA L40S", 864),
    ("NVIDIA GeForce RTX 4090", 1008),
    ("NVIDIA B200", 8000),
    ("AMD Instinct MI300X", 5300),
    ("AMD Instinct MI325X", 6000),
]


@pytest.mark.parametrize(("device_name", "gb_per_sec"), DATASHEET_GB_PER_SEC)
def test_bandwidth_table_gives_the_datasheet_figure(device_name: str, gb_per_sec: float) -> None:
    found = table_bandwidth(device_name)
    assert found is not None and found.bytes_per_sec == gb_per_sec * 1e9
    chip = chip_for(device_name)
    assert chip is not None and found.source.startswith(f"{chip.name}, ")


def test_every_chip_has_a_bandwidth_with_a_source_and_mig_slices_have_none() -> None:
    assert set(BANDWIDTHS) == set(CHIPS)
    for variants, source in BANDWIDTHS.values():
        assert source and variants[-1][0] == "" and all(value > 0 for _, value in variants)
    assert table_bandwidth("NVIDIA H100 80GB HBM3 MIG 1g.10gb") is None
    assert table_bandwidth("Tesla V100-SXM2-32GB") is None


@pytest.mark.parametrize("value", [0, -1.0, "3e12", True, float("inf"), float("nan")])
def test_bad_peak_bandwidth_fails_at_construction_naming_the_argument(value: object) -> None:
    with pytest.raises(ValueError, match="peak_bandwidth must be the peak memory bandwidth of one device"):
        Options(peak_bandwidth=value)  # type: ignore[arg-type]


def test_bandwidth_environment_variable_and_the_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BANDWIDTH_ENV_VAR, "2e12")
    from_env = Bandwidth(2e12, f"{BANDWIDTH_ENV_VAR} environment variable")
    assert StepSession(Options(), "test").given_bandwidth == from_env
    given = StepSession(Options(peak_bandwidth=1e12), "test").given_bandwidth
    assert given == Bandwidth(1e12, "peak_bandwidth argument")
    cpu = torch.device("cpu")
    assert resolve_bandwidth(given, cpu) == (given, "")
    found, why = resolve_bandwidth(None, cpu)
    assert found is None
    assert why == f"no peak bandwidth for a cpu device: pass peak_bandwidth= or set {BANDWIDTH_ENV_VAR}"
    monkeypatch.setenv(BANDWIDTH_ENV_VAR, "fast")
    with pytest.raises(ValueError, match=f"{BANDWIDTH_ENV_VAR} must be the peak memory bandwidth"):
        StepSession(Options(), "test")


# --- the compute dtype, from the frameworks' own objects -------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16-mixed", BF16), ("bf16-true", BF16), ("16-true", FP16), ("32-true", FP32), ("64-true", FP64)],
)
def test_lightning_precision_plugin_gives_the_compute_dtype(
    precision: str, dtype: str | None, restore_matmul_precision: None
) -> None:
    torch.set_float32_matmul_precision("highest")
    trainer = L.Trainer(accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False)
    assert lightning.compute_dtype(trainer, torch.nn.Linear(2, 2)) == dtype


def test_lightning_fp32_with_tf32_allowed_and_transformer_engine(restore_matmul_precision: None) -> None:
    trainer = L.Trainer(accelerator="cpu", precision="32-true", logger=False, enable_progress_bar=False)
    torch.set_float32_matmul_precision("high")
    assert lightning.compute_dtype(trainer, torch.nn.Linear(2, 2, device="meta")) == TF32  # off a CPU
    assert lightning.compute_dtype(trainer, torch.nn.Linear(2, 2)) == FP32  # oneDNN's "tf32": the fp32 rate
    # TransformerEnginePrecision cannot be built without transformer_engine: its precision string only
    assert lightning.compute_dtype(SimpleNamespace(precision="transformer-engine"), None) == FP8


def test_hf_training_arguments_give_the_compute_dtype(restore_matmul_precision: None) -> None:
    torch.set_float32_matmul_precision("highest")
    model = torch.nn.Linear(2, 2)

    def args(**flags: object) -> TrainingArguments:
        return TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **flags)

    assert hf.compute_dtype(args(bf16=True), model) == BF16
    assert hf.compute_dtype(args(fp16=True), model) == FP16
    assert hf.compute_dtype(args(), model) == FP32
    assert hf.compute_dtype(args(), model.to(torch.bfloat16)) == BF16  # a model loaded in bf16
    assert hf.compute_dtype(args(), model, SimpleNamespace(mixed_precision="fp8")) == FP8
    torch.set_float32_matmul_precision("high")
    assert hf.compute_dtype(args(), torch.nn.Linear(2, 2, device="meta")) == TF32  # off a CPU


def test_a_loops_own_autocast_is_the_compute_dtype_its_counted_matmuls_ran_in() -> None:
    """A plain loop under ``torch.autocast`` (bf16 on the CPU): the parameters stay fp32, the matmuls
    produce bf16, and the peak is read for bf16 (an H100's fp32 peak is 15x below its bf16 one). A dtype
    the framework declared stays: fp8 (TransformerEngine) runs its matmuls as no aten op shows."""
    from flops_callbacks import StepProfiler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = StepProfiler(model, profile_step=1, clean_steps=1, print_profile=False, peak_flops=1e12)
    for _ in range(8):
        x = torch.randn(4, 8)
        with prof.step(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    prof.close()
    assert prof.result is not None and prof.result.compute_dtype == BF16
    assert measured_dtype(FP32, torch.float16) == FP16 and measured_dtype(None, torch.bfloat16) == BF16
    assert measured_dtype(FP8, torch.bfloat16) == FP8 and measured_dtype(BF16, torch.float32) == BF16
    assert measured_dtype(TF32, torch.float32) == TF32 and measured_dtype(FP32, None) == FP32
