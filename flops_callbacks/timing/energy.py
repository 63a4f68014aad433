"""A device's energy counter, read in joules (what readings come to: :mod:`.energy_figures`).

NVIDIA GPUs: NVML's total-energy counter (Volta and later: one call, millijoules since the driver
loaded), or where the GPU lacks it, NVML's power integrated by a thread sampling through the window.
CPUs: RAPL through Linux's powercap files (the package domains and their DRAM subdomains; AMD exposes
the same files), each counter's wrap handled between two reads. Anything else gets no counter, and the
reason why as a string, which the caller says once. ``nvidia-ml-py`` (the ``energy`` extra) is imported
only when a CUDA device's counter is asked for: the core depends on torch alone.

What is measured is the device's own counter, not the wall socket: host, network and cooling are left out.

Why not torch: ``torch.cuda.power_draw`` reads power, not energy, and starts NVML on every call; its
CUDA_VISIBLE_DEVICES mapping (``torch.cuda._get_nvml_device_index``) is private. Why not Zeus's
``ZeusMonitor``: at construction it opens every GPU, CPU and SoC, and spawns a process per RAPL file to
watch for wraps and one for power polling, all of which run for the whole job (a cost outside the window);
it synchronizes the GPUs at each window's ends, and it pulls in pydantic and httpx. Here one device's
counter is read once at each window step's end (one file read per RAPL domain, one NVML call), and a
thread runs only inside the window, only where the GPU needs it.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "energy_counter",
    "EnergyCounter",
    "nvml_counter",
    "nvml_index",
    "NvmlEnergy",
    "POWERCAP_ROOT",
    "rapl_counter",
    "RaplEnergy",
    "read_failure",
    "SampledPower",
]

POWERCAP_ROOT = Path("/sys/class/powercap")
INSTALL_HINT = "pip install nvidia-ml-py (from a checkout of flops_callbacks: pip install '.[energy]')"
# NB: NVIDIA does not publish how often the total-energy counter moves; it is observed to step about every
# 100 ms from Volta to Hopper (Zeus documents the same), so a reading is up to that stale.
NVML_ENERGY_RESOLUTION_S = 0.1
# NVML's power is an average over the sensor's last period: 1/6 s to 1 s by product (torch.cuda.power_draw's
# docstring); the sampled figure can be no finer than the longest of them.
NVML_POWER_RESOLUTION_S = 1.0
SAMPLE_INTERVAL_S = 0.02  # the power-sampling thread's period
# RAPL's energy status registers update about every millisecond (Intel's SDM; AMD's are the same interface).
RAPL_RESOLUTION_S = 0.001


class EnergyCounter(Protocol):
    """One device's energy counter: joules from a fixed origin, never decreasing, cheap to read.

    ``source`` names what is read ("NVML total energy", "NVML power, sampled", "RAPL package+dram");
    ``resolution`` is how stale a reading may be, in seconds; ``scope`` names the hardware it measures, the
    same string on every rank that reads the same hardware (a job sums each scope once).
    """

    source: str
    resolution: float
    scope: str

    def start(self) -> None:
        """The window starts: run what the counter needs meanwhile (only sampled power runs anything)."""

    def read(self) -> float:
        """Joules from the counter's origin, now (raises ``OSError`` or NVML's error if the read fails)."""

    def stop(self) -> None:
        """The window ends: stop what ``start`` ran; nothing runs outside the window."""


class NvmlEnergy:
    """NVML's total-energy counter of one GPU (millijoules since the driver loaded; Volta and later).

    Args:
        millijoules: reads the counter (``nvmlDeviceGetTotalEnergyConsumption`` of the GPU's handle).
        scope: the GPU measured (its UUID, "GPU-...").
    """

    source = "NVML total energy"
    resolution = NVML_ENERGY_RESOLUTION_S

    def __init__(self, millijoules: Callable[[], int], scope: str) -> None:
        self._millijoules = millijoules
        self.scope = scope

    def start(self) -> None:
        pass

    def read(self) -> float:
        return self._millijoules() / 1000.0

    def stop(self) -> None:
        pass


class SampledPower:
    """Energy as power integrated over time, where a GPU has no energy counter: an approximation.

    Each sample holds its power until the next (a left Riemann sum), so readings never decrease and a
    read at the window's ends integrates exactly up to that moment. A thread samples every ``interval``
    between ``start`` and ``stop``; power between windows is not integrated. NB: NVML's power is itself an
    average over the sensor's period (up to 1 s), so steps shorter than that are smeared together.

    Args:
        watts: reads the power now (NVML's milliwatts over 1000).
        scope: the hardware measured.
        clock: seconds, monotonic (a fake one in tests).
        interval: seconds between the thread's samples.
    """

    source = "NVML power, sampled"
    resolution = NVML_POWER_RESOLUTION_S

    def __init__(
        self,
        watts: Callable[[], float],
        scope: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self._watts = watts
        self.scope = scope
        self._clock = clock
        self.interval = interval
        self._lock = threading.Lock()
        self._joules = 0.0
        self._last: tuple[float, float] | None = None  # (time, watts) of the latest sample
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self.read()
        self._halt.clear()
        self._thread = threading.Thread(target=self._sample, name="flops-callbacks-power", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.read()
            except Exception:  # the window's own read meets the same failure, and says it
                return

    def read(self) -> float:
        with self._lock:
            watts, now = self._watts(), self._clock()
            if self._last is not None:
                then, before = self._last
                self._joules += before * (now - then)
            self._last = (now, watts)
            return self._joules

    def stop(self) -> None:
        if self._thread is None:
            return
        self._halt.set()
        self._thread.join()
        self._thread = None
        self._last = None  # the next window integrates from its own first sample


@dataclass
class _Zone:
    """One RAPL domain's ``energy_uj`` file, its range and its last raw reading (microjoules)."""

    path: Path
    range_uj: int
    last_uj: int


class RaplEnergy:
    """The RAPL package domains of this host and their DRAM subdomains, summed, each counter's wrap handled.

    A counter runs from 0 to ``max_energy_range_uj`` and starts again at 0: a reading below the previous
    one has wrapped once, unless that would make more than half a range since it: then the counter was
    reset (a driver reload, a suspend) and the total goes back by as much, which every span over it reads
    as a counter that went back (no figure), not as a wrap's hundreds of kilojoules. Two reads more than
    half a range apart (about 131 kJ on Intel: 11 minutes at 200 W) are taken for a reset, so read more
    often (the throughput meter reads every few seconds:
    :data:`~flops_callbacks.session.energy_reads.KEEP_UP_S`).

    Args:
        zones: each domain's ``energy_uj`` file, its ``max_energy_range_uj`` and its first reading.
        source: "RAPL package" or "RAPL package+dram".
        scope: the host measured ("RAPL on <hostname>"): every process on a host reads the same counters.
        read_text: reads a file (injected in tests).
    """

    resolution = RAPL_RESOLUTION_S

    def __init__(
        self,
        zones: list[tuple[Path, int, int]],
        source: str,
        scope: str,
        read_text: Callable[[Path], str],
    ) -> None:
        self.source = source
        self.scope = scope
        self._read_text = read_text
        self._zones = [_Zone(*zone) for zone in zones]
        self._total_uj = sum(zone.last_uj for zone in self._zones)

    def start(self) -> None:
        pass

    def read(self) -> float:
        for zone in self._zones:
            now = int(self._read_text(zone.path))
            if not 0 <= now <= zone.range_uj:
                raise ValueError(f"{zone.path} reads {now}, outside 0 .. max_energy_range_uj={zone.range_uj}")
            wrapped = now < zone.last_uj and zone.range_uj - zone.last_uj + now <= zone.range_uj // 2
            self._total_uj += (zone.range_uj - zone.last_uj + now) if wrapped else now - zone.last_uj
            zone.last_uj = now
        return self._total_uj / 1e6

    def stop(self) -> None:
        pass


def _read_text(path: Path) -> str:
    """A small sysfs file's text, opened and read afresh: a quarter of ``Path.read_text``'s cost."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 64).decode()
    finally:
        os.close(fd)


def _why(err: OSError | ValueError) -> str:
    return (err.strerror if isinstance(err, OSError) else None) or str(err) or type(err).__name__


def _zone_name(zone: Path, read_text: Callable[[Path], str]) -> str:
    try:
        return read_text(zone / "name").strip()
    except OSError:
        return ""


def rapl_counter(root: Path | None = None, read_text: Callable[[Path], str] = _read_text) -> RaplEnergy | str:
    """This host's RAPL counter (packages, plus DRAM where exposed), or why there is none.

    Args:
        root: the powercap folder; None: :data:`POWERCAP_ROOT` as it is now (a fake tree in tests).
        read_text: reads a file (injected in tests).
    """
    root = POWERCAP_ROOT if root is None else root
    if not root.is_dir():
        return f"no RAPL counter: {root} does not exist (no powercap interface on this machine)"
    try:
        # NB: only domains named package-N: a "psys" top domain (some laptops) already holds the packages.
        top = sorted(p for p in root.iterdir() if re.fullmatch(r"intel-rapl:\d+", p.name))
        packages = [p for p in top if _zone_name(p, read_text).startswith("package")]
        drams = [
            sub
            for package in packages
            for sub in sorted(package.iterdir())
            if re.fullmatch(r"intel-rapl:\d+:\d+", sub.name) and _zone_name(sub, read_text) == "dram"
        ]
    except OSError as err:
        return f"no RAPL counter: {root} cannot be listed ({_why(err)})"
    if not packages:
        return f"no RAPL counter: no package domain (intel-rapl:N named package-N) under {root}"
    zones: list[tuple[Path, int, int]] = []
    for zone in packages + drams:
        file = zone / "energy_uj"
        try:
            zones.append((file, int(read_text(zone / "max_energy_range_uj")), int(read_text(file))))
        except (OSError, ValueError) as err:
            return (
                f"no RAPL counter: {zone} cannot be read ({_why(err)}; energy_uj is readable by root only "
                "on many kernels)"
            )
    source = "RAPL package+dram" if drams else "RAPL package"
    return RaplEnergy(zones, source, f"RAPL on {socket.gethostname()}", read_text)


def nvml_index(index: int, visible: str | None, uuids: Callable[[], list[str]]) -> int | str:
    """NVML's index of torch's CUDA device ``index``, or why there is none.

    NVML numbers every GPU; torch numbers those CUDA_VISIBLE_DEVICES lists, in its order. Entries are
    indices or GPU UUIDs (a unique prefix is enough); as in CUDA, the list ends at the first entry that
    is neither.

    Args:
        index: torch's device index.
        visible: CUDA_VISIBLE_DEVICES, None when unset.
        uuids: NVML's UUIDs ("GPU-..."), by NVML index (called only when an entry is a UUID).
    """
    if visible is None:
        return index
    nvml: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            nvml.append(int(entry))
        elif entry.startswith("GPU-"):
            matches = [i for i, uuid in enumerate(uuids()) if uuid.startswith(entry)]
            if len(matches) != 1:
                break
            nvml.append(matches[0])
        elif entry.startswith("MIG-"):
            return f"CUDA device {index} is a MIG instance ({entry}): NVML keeps no energy per instance"
        else:
            break
    if not 0 <= index < len(nvml):
        return f"CUDA device {index} is not among CUDA_VISIBLE_DEVICES={visible!r}"
    return nvml[index]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _torch_uuid(index: int) -> str | None:
    """The GPU's UUID as CUDA reports it ("GPU-..."), or None where torch cannot tell."""
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except (AssertionError, RuntimeError, AttributeError):  # a CPU build raises AssertionError
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _nvml_handle(pynvml: Any, index: int) -> Any:
    """The NVML handle of torch's device ``index``, or why there is none (NVML errors raise).

    By the UUID torch reports first: exact whatever CUDA_DEVICE_ORDER is; by CUDA_VISIBLE_DEVICES where
    torch cannot tell (its indices assume CUDA's order is NVML's PCI bus order).
    """
    uuid = _torch_uuid(index)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            pass  # e.g. a MIG instance: CUDA_VISIBLE_DEVICES says which

    def uuids() -> list[str]:
        count = pynvml.nvmlDeviceGetCount()
        return [_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]

    nvml = nvml_index(index, os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
    return nvml if isinstance(nvml, str) else pynvml.nvmlDeviceGetHandleByIndex(nvml)


def nvml_counter(
    index: int, *, clock: Callable[[], float] = time.monotonic, interval: float = SAMPLE_INTERVAL_S
) -> NvmlEnergy | SampledPower | str:
    """The counter of torch's CUDA device ``index`` through NVML, or why there is none.

    The total-energy counter where the GPU has one, else its power sampled (see ``SampledPower``).

    Args:
        index: torch's CUDA device index.
        clock: the sampled power's clock.
        interval: the sampled power's period, in seconds.
    """
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        return f"no NVML counter: nvidia-ml-py is not installed ({INSTALL_HINT})"
    try:
        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, index)
        if isinstance(handle, str):
            return f"no NVML counter: {handle}"
        scope = _text(pynvml.nvmlDeviceGetUUID(handle))  # "GPU-..."
    except pynvml.NVMLError as err:
        return f"no NVML counter for CUDA device {index}: {err}"
    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return NvmlEnergy(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), scope)
    except pynvml.NVMLError as err:
        no_energy = str(err)
    try:
        pynvml.nvmlDeviceGetPowerUsage(handle)
    except pynvml.NVMLError as err:
        return (
            f"no NVML counter for CUDA device {index}: neither its total energy ({no_energy}) "
            f"nor its power ({err}) can be read"
        )
    watts = lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # noqa: E731
    return SampledPower(watts, scope, clock=clock, interval=interval)


def read_failure(counter: EnergyCounter, error: Exception) -> str:
    """The line that says a read of ``counter`` failed (and so there is no energy figure)."""
    return f"reading the {counter.source} counter failed ({type(error).__name__}: {error})"


def energy_counter(device: torch.device, *, powercap_root: Path | None = None) -> EnergyCounter | str:
    """The cheapest correct energy counter of ``device``, or one line saying why there is none.

    Args:
        device: the device the model runs on.
        powercap_root: where a CPU's RAPL files are; None: :data:`POWERCAP_ROOT` as it is now (a test, or
            a host that mounts sysfs elsewhere, sets ``flops_callbacks.timing.energy.POWERCAP_ROOT``).
    """
    if device.type == "cuda":
        if torch.version.hip:
            return "no energy counter: ROCm GPUs are not read (only NVIDIA GPUs, through NVML)"
        index = device.index
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return nvml_counter(index)
    if device.type == "cpu":
        return rapl_counter(POWERCAP_ROOT if powercap_root is None else powercap_root)
    return f"no energy counter for {device.type} devices (read: NVIDIA GPUs through NVML, CPUs through RAPL)"
