"""CRIU runs without its plugins: a CRIU whose plugin directory holds a CUDA plugin would act
on CHECKPOINTED processes itself at restore, without the GPU map (issue 10 §2.3)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.host.criu import Criu
from tests.support import workloads
from tests.support.criu import criu_or_skip

pytestmark = [pytest.mark.criu]

PLUGIN = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void loaded(void) {
    int fd = open(MARK, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0)
        close(fd);
}
"""


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """$CRIU_LIBS_DIR with a ``cuda_plugin.so`` that leaves ``loaded`` beside it when loaded."""
    criu_or_skip()
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here (scripts/bootstrap.sh installs it)")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (tmp_path / "plugin.c").write_text(PLUGIN)
    mark = plugins.parent / "loaded"
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            f'-DMARK="{mark}"',
            "-o",
            str(plugins / "cuda_plugin.so"),
            str(tmp_path / "plugin.c"),
        ],
        check=True,
    )
    monkeypatch.setenv("CRIU_LIBS_DIR", str(plugins))
    yield plugins


def test_criu_loads_no_plugin_at_dump_or_restore(
    plugin_dir: Path, tmp_path: Path, started: workloads.Started
) -> None:
    criu = Criu()
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    images = tmp_path / "images"
    criu.dump(w.pid, images, leave_running=False, log_path=tmp_path / "dump.log")
    w.reap()
    restored = criu.restore(
        images, log_path=tmp_path / "restore.log", pidfile=tmp_path / "pid", sibling=True
    )
    try:
        assert restored.pid == w.pid
        assert not (plugin_dir.parent / "loaded").exists()
        w.wait_steps(w.steps_done() + 2)  # it runs on, as CRIU alone restored it
    finally:
        workloads.kill_tree(restored.pid)
        os.waitpid(restored.pid, 0)  # --restore-sibling made it our child
