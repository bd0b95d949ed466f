from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.gpu import GpuCoordinator
from tests.fakes.fake_cuda import STATE_ENV, FakeCuda

FAKE = "module:tests.fakes.fake_cuda"


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    path = tmp_path / "fake-cuda.json"
    monkeypatch.setenv(STATE_ENV, str(path))
    return FakeCuda(path).setup()


@pytest.fixture
def sleepers() -> Iterator[Callable[[int], list[int]]]:
    """Real processes to stand in for the workload's pids."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(n: int) -> list[int]:
        for _ in range(n):
            procs.append(subprocess.Popen(["sleep", "600"]))
        return [p.pid for p in procs[-n:]]

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def make_coordinator(fake: FakeCuda) -> Iterator[Callable[..., GpuCoordinator]]:
    made: list[GpuCoordinator] = []

    def make(**kwargs: object) -> GpuCoordinator:
        kwargs.setdefault("driver", FAKE)
        kwargs.setdefault("call_timeout_s", 20.0)
        coordinator = GpuCoordinator.create(**kwargs)  # type: ignore[arg-type]
        made.append(coordinator)
        return coordinator

    yield make
    for c in made:
        c.close()
