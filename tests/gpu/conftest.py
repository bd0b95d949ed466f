"""Skip the whole GPU suite cleanly unless this machine has a working NVIDIA GPU and torch."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

FIGURES_ENV = "GPUSNAP_FIGURES"


def _gpu_missing() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi: no NVIDIA GPU on this machine"
    try:
        from cuda.bindings import driver as cu  # noqa: PLC0415 - may not load

        (err,) = cu.cuInit(0)
    except Exception as exc:
        return f"cuInit failed: {type(exc).__name__}"
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuInit failed: {err.name}"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [i for i in items if here in Path(str(i.fspath)).parents]
    if not ours:
        return
    why = _gpu_missing()
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        # The machine's one GPU (its free memory is measured): one xdist worker uses it.
        item.add_marker(pytest.mark.xdist_group("gpu"))
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _adopt_orphans(child_subreaper: None) -> None:
    """Every test here runs as the orphans' subreaper (``child_subreaper``)."""


@pytest.fixture
def figures() -> Any:
    """Record a figure: printed, and appended to $GPUSNAP_FIGURES (JSON lines) if set."""

    def record(name: str, **values: Any) -> None:
        line = json.dumps({"figure": name, **values})
        print(f"FIGURE {line}")
        if path := os.environ.get(FIGURES_ENV):
            with open(path, "a") as f:
                f.write(line + "\n")

    return record
