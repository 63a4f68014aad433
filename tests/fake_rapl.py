"""A fake powercap tree whose RAPL counters the tests advance by known amounts: by the model's forward
(``add``) or by a background thread at a constant power (``burning``); every write atomic (a reader sees
the old file or the new one, never half of one), and the counter readable by hand (``joules``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import flops_callbacks.timing.energy as energy

RANGE_UJ = 262_143_328_850  # an Intel package's max_energy_range_uj


class FakeRapl:
    """One package domain and its DRAM subdomain under ``root``; the package takes what is added, the
    DRAM a tenth more (so that both files are read)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.package = root / "intel-rapl:0"
        self.dram = self.package / "intel-rapl:0:0"
        self._uj = {self.package: 5_000_000, self.dram: 500_000}
        for folder, name in ((self.package, "package-0"), (self.dram, "dram")):
            folder.mkdir(parents=True)
            (folder / "name").write_text(f"{name}\n")
            (folder / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
            self._write(folder)
        self._lock = threading.Lock()

    def _write(self, folder: Path) -> None:
        tmp = folder / "energy_uj.tmp"
        tmp.write_text(f"{self._uj[folder] % RANGE_UJ}\n")
        os.replace(tmp, folder / "energy_uj")

    def add(self, joules: float) -> None:
        """``joules`` more on the package, a tenth of that on the DRAM."""
        with self._lock:
            self._uj[self.package] += round(joules * 1e6)
            self._uj[self.dram] += round(joules * 1e5)
            self._write(self.package)
            self._write(self.dram)

    def joules(self) -> float:
        """The counter as read by hand: both files, in joules (no wrap in a test's run)."""
        return sum(int((f / "energy_uj").read_text()) for f in (self.package, self.dram)) / 1e6

    @contextmanager
    def burning(self, watts: float, period: float = 0.001) -> Iterator[None]:
        """A background thread adds ``watts`` (package + DRAM) for every second that passes, every
        ``period`` seconds, until the block ends."""
        halt = threading.Event()

        def burn() -> None:
            last = time.perf_counter()
            while not halt.wait(period):
                now = time.perf_counter()
                self.add((now - last) * watts / 1.1)  # the DRAM's tenth on top
                last = now

        thread = threading.Thread(target=burn, daemon=True)
        thread.start()
        try:
            yield
        finally:
            halt.set()
            thread.join()


def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeRapl:
    """A fake RAPL tree that the energy counter reads (``POWERCAP_ROOT`` pointed at it)."""
    fake = FakeRapl(tmp_path / "powercap")
    monkeypatch.setattr(energy, "POWERCAP_ROOT", fake.root)
    return fake


def remove(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No powercap folder (as on this machine): no energy counter on a CPU."""
    missing = tmp_path / "no-powercap"
    monkeypatch.setattr(energy, "POWERCAP_ROOT", missing)
    return missing


class Burner(torch.nn.Module):
    """A small MLP whose forward adds ``joules`` to the fake counter (none in a generation's counting run:
    any call adds) and sleeps ``sleep`` seconds."""

    def __init__(self, rapl: FakeRapl | None, joules: float = 0.0, sleep: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.rapl, self.joules, self.sleep = rapl, joules, sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rapl is not None and self.joules:
            self.rapl.add(self.joules)
        if self.sleep:
            time.sleep(self.sleep)
        return self.net(x)
