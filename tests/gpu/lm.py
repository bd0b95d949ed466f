"""Running ``device_lm.py`` (a model whose state lives in device memory) as tests need it:
on a fake node (``tests/e2e_gpu``) or on a GPU (``tests/gpu``), given the environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.workloads import Workload

DEVICE_LM = Path(__file__).resolve().with_name("device_lm.py")


def device_lm_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(DEVICE_LM), str(out), *args]


def start_device_lm(env: dict[str, str], workdir: Path, *args: str, steps: int) -> Workload:
    """``tests/gpu/device_lm.py`` in ``env`` (a fake node's, or a GPU's), as CRIU wants a
    tree: its own session, no terminal, stdio on files."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "tokens"
    cmd = device_lm_command(out, "--steps", str(steps), *args)
    with open(workdir / "log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
    return Workload("device_lm", proc, workdir, out, steps)


def reference_tokens(env: dict[str, str], workdir: Path, *args: str, steps: int) -> bytes:
    """The tokens of an uninterrupted run, without pauses."""
    out = workdir / "reference"
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        device_lm_command(out, "--steps", str(steps), *args),
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    return out.read_bytes()
