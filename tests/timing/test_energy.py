"""Energy counters: RAPL's powercap files summed exactly with their wrap, NVML's total energy or its power
integrated where the counter is missing, torch's device mapped through CUDA_VISIBLE_DEVICES, a reason
where no counter can be read, and a window's figures worked out by hand."""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from flops_callbacks.timing.energy import (
    POWERCAP_ROOT,
    NvmlEnergy,
    RaplEnergy,
    SampledPower,
    energy_counter,
    nvml_counter,
    nvml_index,
    rapl_counter,
)
from flops_callbacks.timing.energy_figures import read, span_over

RANGE_UJ = 262_143_328_850  # an Intel package's max_energy_range_uj


def zone(folder: Path, name: str, energy_uj: int, range_uj: int = RANGE_UJ) -> Path:
    folder.mkdir(parents=True)
    (folder / "name").write_text(f"{name}\n")
    (folder / "energy_uj").write_text(f"{energy_uj}\n")
    (folder / "max_energy_range_uj").write_text(f"{range_uj}\n")
    return folder


def set_uj(folder: Path, energy_uj: int) -> None:
    (folder / "energy_uj").write_text(f"{energy_uj}\n")


@pytest.fixture
def two_sockets(tmp_path: Path) -> dict[str, Path]:
    """Two packages, each with a DRAM and a core subdomain, and a psys domain that already holds both."""
    root = tmp_path / "powercap"
    pkg0 = zone(root / "intel-rapl:0", "package-0", 1_000_000)
    pkg1 = zone(root / "intel-rapl:1", "package-1", 2_000_000)
    return {
        "root": root,
        "pkg0": pkg0,
        "dram0": zone(pkg0 / "intel-rapl:0:0", "dram", 250_000),
        "core0": zone(pkg0 / "intel-rapl:0:1", "core", 9_000_000),
        "pkg1": pkg1,
        "dram1": zone(pkg1 / "intel-rapl:1:0", "dram", 500_000),
        "psys": zone(root / "intel-rapl:2", "psys", 7_000_000),
    }


# -- RAPL ------------------------------------------------------------------------------------------------


def test_rapl_sums_both_packages_and_their_dram_and_leaves_out_core_and_psys(two_sockets) -> None:
    counter = rapl_counter(two_sockets["root"])
    assert isinstance(counter, RaplEnergy)
    assert counter.source == "RAPL package+dram" and counter.resolution == 0.001
    assert counter.scope.startswith("RAPL on ")
    assert counter.read() == 3.75  # 1 + 0.25 + 2 + 0.5 J
    set_uj(two_sockets["pkg0"], 4_000_000)  # +3 J
    set_uj(two_sockets["dram0"], 750_000)  # +0.5 J
    set_uj(two_sockets["pkg1"], 3_500_000)  # +1.5 J
    set_uj(two_sockets["dram1"], 750_000)  # +0.25 J
    set_uj(two_sockets["core0"], 99_000_000)  # inside package-0 already: not added
    set_uj(two_sockets["psys"], 99_000_000)  # the whole platform: not added
    assert counter.read() == 9.0  # 3.75 + 5.25 J


def test_a_counter_that_wraps_past_its_range_between_two_reads_adds_what_ran_to_the_end_and_from_zero(
    tmp_path: Path,
) -> None:
    pkg = zone(tmp_path / "intel-rapl:0", "package-0", 9_000_000, range_uj=10_000_000)
    counter = rapl_counter(tmp_path)
    assert isinstance(counter, RaplEnergy) and counter.source == "RAPL package"
    first = counter.read()
    set_uj(pkg, 500_000)  # 1 J to the range's end, then 0.5 J from zero
    second = counter.read()
    set_uj(pkg, 2_500_000)  # +2 J, no wrap
    third = counter.read()
    assert (first, second, third) == (9.0, 10.5, 12.5)


def test_a_counter_reset_reads_as_going_back_and_a_reading_outside_its_range_is_refused(
    tmp_path: Path,
) -> None:
    """A drop that would be a wrap of over half a range is a reset (a driver reload, a suspend): the total
    goes back by it, so that every span over it reads no figure, not a wrap of the whole range."""
    pkg = zone(tmp_path / "intel-rapl:0", "package-0", 5_000_000, range_uj=262_143_328_850)
    counter = rapl_counter(tmp_path)
    assert isinstance(counter, RaplEnergy)
    assert counter.read() == 5.0
    set_uj(pkg, 1_000_000)  # reset to 1 J: a wrap would add 262 kJ
    assert counter.read() == 1.0
    set_uj(pkg, 3_000_000)  # +2 J from there
    assert counter.read() == 3.0
    for raw in (-5, 262_143_328_851):
        set_uj(pkg, raw)
        with pytest.raises(ValueError, match=f"reads {raw}, outside 0 .. max_energy_range_uj=262143328850"):
            counter.read()


def test_an_energy_file_that_cannot_be_read_means_no_counter_with_the_reason_even_as_root(
    tmp_path: Path,
) -> None:
    pkg = zone(tmp_path / "intel-rapl:0", "package-0", 1)
    (pkg / "energy_uj").unlink()
    (pkg / "energy_uj").mkdir()  # unreadable for root too (chmod 000 is not)
    reason = rapl_counter(tmp_path)
    assert isinstance(reason, str)
    assert reason.startswith("no RAPL counter: ") and str(pkg) in reason and "Is a directory" in reason


def test_a_root_only_energy_file_says_permission_denied_and_why(tmp_path: Path) -> None:
    zone(tmp_path / "intel-rapl:0", "package-0", 1)

    def read_text(path: Path) -> str:
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return path.read_text()

    reason = rapl_counter(tmp_path, read_text=read_text)
    assert isinstance(reason, str)
    assert "Permission denied" in reason and "root only" in reason


def test_a_range_that_is_not_a_number_means_no_counter(tmp_path: Path) -> None:
    pkg = zone(tmp_path / "intel-rapl:0", "package-0", 1)
    (pkg / "max_energy_range_uj").write_text("n/a\n")
    reason = rapl_counter(tmp_path)
    assert isinstance(reason, str) and reason.startswith("no RAPL counter: ") and "n/a" in reason


def test_no_powercap_folder_or_no_package_domain_in_it_says_what_is_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert energy_counter(torch.device("cpu"), powercap_root=missing) == (
        f"no RAPL counter: {missing} does not exist (no powercap interface on this machine)"
    )
    zone(tmp_path / "intel-rapl:0", "psys", 1)
    assert energy_counter(torch.device("cpu"), powercap_root=tmp_path) == (
        f"no RAPL counter: no package domain (intel-rapl:N named package-N) under {tmp_path}"
    )


def test_the_counter_reads_the_powercap_root_as_set_now_and_a_folder_it_cannot_list_gives_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flops_callbacks.timing.energy as energy

    zone(tmp_path / "intel-rapl:0", "package-0", 2_000_000)
    monkeypatch.setattr(energy, "POWERCAP_ROOT", tmp_path)  # what tests and odd sysfs mounts do
    counter = energy_counter(torch.device("cpu"))
    assert isinstance(counter, RaplEnergy) and counter.read() == 2.0

    def denied(path: Path) -> object:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "iterdir", denied)
    assert (
        energy_counter(torch.device("cpu"))
        == f"no RAPL counter: {tmp_path} cannot be listed (Permission denied)"
    )


def test_this_machines_cpu_has_no_rapl_files_and_the_reason_says_so() -> None:
    if POWERCAP_ROOT.exists():
        pytest.skip("this machine has a powercap folder")
    reason = energy_counter(torch.device("cpu"))
    assert (
        reason == f"no RAPL counter: {POWERCAP_ROOT} does not exist (no powercap interface on this machine)"
    )


def test_a_device_with_no_known_counter_gets_a_reason() -> None:
    reason = energy_counter(torch.device("meta"))
    assert isinstance(reason, str) and reason.startswith("no energy counter for meta devices")


# -- NVML, through a fake pynvml -------------------------------------------------------------------------


class FakeNvml(types.ModuleType):
    """pynvml's calls that the counters make, over GPUs given as {uuid, energy_mj, power_mw}; a None
    value is a call the GPU does not support."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[dict[str, object]], init_error: str | None = None) -> None:
        super().__init__("pynvml")
        self.gpus = gpus
        self.init_error = init_error

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise self.NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for index, gpu in enumerate(self.gpus):
            if gpu["uuid"] == uuid:
                return index
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(self.gpus[handle]["uuid"])

    def _value(self, handle: int, key: str) -> int:
        value = self.gpus[handle][key]
        if value is None:
            raise self.NVMLError("Not Supported")
        assert isinstance(value, int)
        return value

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self._value(handle, "energy_mj")

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._value(handle, "power_mw")


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeNvml]]:
    """Installs a fake pynvml; torch reports no UUID (as a CPU build) and CUDA_VISIBLE_DEVICES is unset."""

    def no_cuda(index: int) -> object:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(gpus: list[dict[str, object]], init_error: str | None = None) -> FakeNvml:
        fake = FakeNvml(gpus, init_error)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    yield install


def gpu(uuid: str, energy_mj: int | None = None, power_mw: int | None = None) -> dict[str, object]:
    return {"uuid": uuid, "energy_mj": energy_mj, "power_mw": power_mw}


def test_a_gpu_with_the_total_energy_counter_reads_it_in_joules(nvml) -> None:
    fake = nvml([gpu("GPU-aaaa", energy_mj=1_234_567, power_mw=300_000)])
    counter = energy_counter(torch.device("cuda", 0))
    assert isinstance(counter, NvmlEnergy)
    assert (counter.source, counter.resolution, counter.scope) == ("NVML total energy", 0.1, "GPU-aaaa")
    counter.start()
    assert counter.read() == 1234.567
    fake.gpus[0]["energy_mj"] = 1_334_567
    assert counter.read() == 1334.567
    counter.stop()


def test_a_gpu_without_the_counter_integrates_its_power_each_sample_held_until_the_next(nvml) -> None:
    fake = nvml([gpu("GPU-aaaa", power_mw=100_000)])
    times = iter([10.0, 10.5, 12.0])
    assert isinstance(energy_counter(torch.device("cuda", 0)), SampledPower)
    counter = nvml_counter(0, clock=lambda: next(times))
    assert isinstance(counter, SampledPower)
    assert (counter.source, counter.resolution, counter.scope) == ("NVML power, sampled", 1.0, "GPU-aaaa")
    assert counter.read() == 0.0  # 100 W from t=10
    fake.gpus[0]["power_mw"] = 300_000
    assert counter.read() == 50.0  # 100 W x 0.5 s; 300 W from t=10.5
    assert counter.read() == 500.0  # + 300 W x 1.5 s


def test_sampled_power_counts_only_the_time_between_start_and_stop() -> None:
    times = iter([0.0, 2.0, 100.0, 101.0])
    counter = SampledPower(lambda: 100.0, "GPU-aaaa", clock=lambda: next(times), interval=3600)
    counter.start()  # t=0
    assert counter.read() == 200.0  # t=2
    counter.stop()
    counter.start()  # t=100: the 98 s between the windows are not integrated
    assert counter.read() == 300.0  # t=101
    counter.stop()


def test_the_sampling_thread_samples_through_the_window_and_is_gone_after_stop() -> None:
    times: list[float] = []

    def clock() -> float:
        times.append(time.monotonic())
        return times[-1]

    counter = SampledPower(lambda: 100.0, "GPU-aaaa", clock=clock, interval=0.02)
    counter.start()
    time.sleep(0.25)
    joules = counter.read()
    counter.stop()
    assert len(times) >= 3  # the start, at least one of the thread's samples (about 12 due), the read
    assert joules == pytest.approx(100.0 * (times[-1] - times[0]), rel=1e-9)
    assert not [t for t in threading.enumerate() if t.name == "flops-callbacks-power"]


def test_a_gpu_with_neither_energy_nor_power_gets_both_reasons(nvml) -> None:
    nvml([gpu("GPU-aaaa")])
    assert energy_counter(torch.device("cuda", 0)) == (
        "no NVML counter for CUDA device 0: neither its total energy (Not Supported) "
        "nor its power (Not Supported) can be read"
    )


def test_nvml_that_does_not_start_or_is_not_installed_gives_a_reason(nvml, monkeypatch) -> None:
    nvml([], init_error="Driver Not Loaded")
    assert energy_counter(torch.device("cuda", 0)) == "no NVML counter for CUDA device 0: Driver Not Loaded"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    reason = energy_counter(torch.device("cuda", 0))
    assert isinstance(reason, str) and "nvidia-ml-py is not installed" in reason and "'.[energy]'" in reason


def test_real_nvml_without_a_gpu_says_it_found_no_driver() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pytest.importorskip("pynvml")
    reason = energy_counter(torch.device("cuda", 0))
    assert isinstance(reason, str) and reason.startswith("no NVML counter for CUDA device 0: "), reason


def test_a_device_beyond_nvmls_gpus_gets_nvmls_reason(nvml) -> None:
    nvml([gpu("GPU-aaaa", energy_mj=1)])
    assert energy_counter(torch.device("cuda", 3)) == "no NVML counter for CUDA device 3: Invalid Argument"


# -- torch's device to NVML's ----------------------------------------------------------------------------


def no_uuids() -> list[str]:
    raise AssertionError("NVML's UUIDs were asked for where no entry is a UUID")


def test_cuda_visible_devices_maps_torchs_index_to_nvmls() -> None:
    uuids = lambda: ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"]  # noqa: E731
    assert nvml_index(1, None, no_uuids) == 1  # unset: the same numbering
    assert nvml_index(1, "2,3", no_uuids) == 3
    assert nvml_index(0, " 2 , 0", no_uuids) == 2
    assert nvml_index(0, "GPU-cccc,GPU-aaaa-1", uuids) == 2  # a unique prefix is enough
    assert nvml_index(1, "GPU-cccc,GPU-aaaa-1", uuids) == 0
    assert nvml_index(1, "GPU-bbbb-2,1", uuids) == 1


def test_the_visible_list_ends_where_cuda_ends_it_and_a_mig_instance_has_no_counter() -> None:
    uuids = lambda: ["GPU-aaaa-1", "GPU-aaaa-2"]  # noqa: E731
    assert nvml_index(1, "0,-1,1", no_uuids) == "CUDA device 1 is not among CUDA_VISIBLE_DEVICES='0,-1,1'"
    assert isinstance(nvml_index(1, "0,GPU-aaaa,1", uuids), str)  # an ambiguous prefix ends the list
    assert isinstance(nvml_index(0, "", no_uuids), str)  # no device visible
    assert nvml_index(0, "MIG-1234", no_uuids) == (
        "CUDA device 0 is a MIG instance (MIG-1234): NVML keeps no energy per instance"
    )


def test_the_counter_reads_the_gpu_that_cuda_visible_devices_names(nvml, monkeypatch) -> None:
    nvml([gpu("GPU-aaaa", energy_mj=1000), gpu("GPU-bbbb", energy_mj=2000), gpu("GPU-cccc", energy_mj=3000)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc,GPU-aaaa")
    counter = energy_counter(torch.device("cuda", 1))
    assert isinstance(counter, NvmlEnergy) and counter.scope == "GPU-aaaa" and counter.read() == 1.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    counter = energy_counter(torch.device("cuda", 1))
    assert isinstance(counter, NvmlEnergy) and counter.scope == "GPU-bbbb" and counter.read() == 2.0
    assert energy_counter(torch.device("cuda", 2)) == (
        "no NVML counter: CUDA device 2 is not among CUDA_VISIBLE_DEVICES='2,1'"
    )


def test_the_uuid_torch_reports_wins_over_cuda_visible_devices(nvml, monkeypatch) -> None:
    nvml([gpu("GPU-aaaa", energy_mj=1000), gpu("GPU-bbbb", energy_mj=2000)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # CUDA's order differs from NVML's: only the UUID is sure
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="bbbb"))
    counter = energy_counter(torch.device("cuda", 0))
    assert isinstance(counter, NvmlEnergy) and counter.scope == "GPU-bbbb"


# -- a real GPU ------------------------------------------------------------------------------------------


def test_a_real_gpus_counter_moves_with_work_and_its_mean_power_is_plausible() -> None:
    if not torch.cuda.is_available() or torch.version.hip:
        pytest.skip("needs an NVIDIA GPU")
    pytest.importorskip("pynvml")
    counter = energy_counter(torch.device("cuda", 0))
    assert not isinstance(counter, str), counter
    x = torch.randn(4096, 4096, device="cuda")
    counter.start()
    torch.cuda.synchronize()
    start, t0 = read(counter), time.perf_counter()
    while time.perf_counter() - t0 < 3.0:
        x = (x @ x).tanh()
    torch.cuda.synchronize()
    span = span_over([(start, read(counter))])
    counter.stop()
    assert span.long_enough and 10.0 < span.joules / span.seconds < 2000.0, span
