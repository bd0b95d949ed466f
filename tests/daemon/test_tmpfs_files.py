"""Real CRIU on a real process that keeps its state in /dev/shm (tests/support/shm_holder.py):
a shared mapping, a file deleted while open (CRIU's link-remap) and a log it writes. Its tmpfs
files are saved with the images while it is frozen and put back before the restore, so it
goes on as if never stopped — with its /dev/shm files gone, as on another node, and with its
log grown after a leave-running dump."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.host import tmpfsfiles
from gpusnap.daemon.host.criu import Criu
from tests.support import workloads
from tests.support.criu import criu_or_skip

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

HOLDER = Path(__file__).parents[1] / "support" / "shm_holder.py"
STEPS = 60


@pytest.fixture(scope="module")
def criu() -> Iterator[Criu]:
    found = criu_or_skip()
    workloads.set_child_subreaper(True)  # adopt what a kill-mode dump leaves, to reap it
    yield found
    workloads.set_child_subreaper(False)


class Holder:
    def __init__(self, workdir: Path, interval: float) -> None:
        workdir.mkdir(parents=True)
        self.workdir = workdir
        self.tag = f"gpusnap-test-{os.getpid()}-{workdir.parent.name[:40]}-{workdir.name}"
        with open(workdir / "stderr", "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HOLDER), str(workdir), self.tag, str(STEPS), str(interval)],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )

    @property
    def log(self) -> Path:
        return self.workdir / "out.log"

    def lines(self) -> int:
        return self.log.read_bytes().count(b"\n") if self.log.exists() else 0

    def wait_lines(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while self.lines() < n:
            assert self.proc.poll() is None, (self.workdir / "stderr").read_text()
            assert time.monotonic() < deadline, f"{self.lines()} lines, waiting for {n}"
            time.sleep(0.02)

    def shm(self) -> list[Path]:
        return sorted(Path("/dev/shm").glob(f"{self.tag}-*"))

    def remove_shm(self) -> None:
        for p in Path("/dev/shm").glob(f"{self.tag}*"):
            p.unlink()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        if h.proc.poll() is None:
            h.proc.kill()
            h.proc.wait()
        for p in Path("/dev/shm").glob(f"{h.tag}*"):
            p.unlink()


def _reference(tmp: Path, holders: list[Holder]) -> bytes:
    h = Holder(tmp / "ref", 0.0)
    holders.append(h)
    assert h.proc.wait(timeout=120) == 0
    return h.log.read_bytes()


def _restore_and_finish(criu: Criu, images: Path, tmp: Path, pid: int) -> None:
    res = criu.restore(
        images, log_path=tmp / "restore.log", pidfile=tmp / "restored.pid", sibling=True
    )
    assert res.pid == pid
    _, status = os.waitpid(res.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _dump_running(
    criu: Criu, tmp: Path, holders: list[Holder], *, leave_running: bool
) -> tuple[bytes, Holder, Path]:
    """An uninterrupted run's log, and a holder dumped after its first 10 steps."""
    reference = _reference(tmp, holders)
    h = Holder(tmp / "run", 0.05)
    holders.append(h)
    h.wait_lines(10)
    images = tmp / "images"
    res = criu.dump(h.proc.pid, images, leave_running=leave_running, log_path=tmp / "dump.log")
    assert res.images_bytes > 0
    return reference, h, images


def test_kill_mode_tmpfs_files_saved_and_put_back_on_a_node_without_them(
    criu: Criu, tmp_path: Path, holders: list[Holder]
) -> None:
    reference, h, images = _dump_running(criu, tmp_path, holders, leave_running=False)
    assert h.proc.wait() == -signal.SIGKILL

    saved = tmpfsfiles.saved(images)
    names = sorted(n for f in saved for n in f["names"])
    assert f"/dev/shm/{h.tag}-seg" in names and f"/dev/shm/{h.tag}-sem" in names
    # The semaphore's deleted name is held through CRIU's link_remap name, saved beside it.
    sem = next(f for f in saved if f"/dev/shm/{h.tag}-sem" in f["names"])
    remaps = [n for n in sem["names"] if os.path.basename(n).startswith("link_remap.")]
    assert len(remaps) == 1
    # The 64 MiB segment is stored sparse: what the holder wrote, not its size.
    seg = next(f for f in saved if f"/dev/shm/{h.tag}-seg" in f["names"])
    assert seg["size"] == 64 << 20
    assert (images / tmpfsfiles.DIR / seg["data"]).stat().st_blocks * 512 < 1 << 20
    # The kill-mode dump's link_remap name is in the checkpoint, not left in /dev/shm.
    assert not Path(remaps[0]).exists()

    h.remove_shm()  # as on another node
    assert h.shm() == []
    _restore_and_finish(criu, images, tmp_path, h.proc.pid)
    assert h.log.read_bytes() == reference


def test_leave_running_tmpfs_files_and_a_grown_log_restore_from_another_directory(
    criu: Criu, tmp_path: Path, holders: list[Holder]
) -> None:
    reference, h, images = _dump_running(criu, tmp_path, holders, leave_running=True)
    # It runs on: its log grows past what CRIU recorded, its counter in /dev/shm moves on.
    at_dump = h.lines()
    h.wait_lines(at_dump + 5)
    # CRIU removed its link_remap name after the leave-running dump; the saved copy has it.
    sem = next(f for f in tmpfsfiles.saved(images) if f"/dev/shm/{h.tag}-sem" in f["names"])
    remap = next(n for n in sem["names"] if os.path.basename(n).startswith("link_remap."))
    assert not Path(remap).exists()
    h.proc.kill()
    h.proc.wait()
    grown = h.log.stat().st_size

    moved = tmp_path / "elsewhere" / "images"
    moved.parent.mkdir()
    shutil.move(images, moved)
    h.remove_shm()
    _restore_and_finish(criu, moved, tmp_path, h.proc.pid)
    out = h.log.read_bytes()
    assert grown > 0 and out == reference
    assert not Path(remap).exists()  # CRIU used it and removed it
    index = json.loads((moved / tmpfsfiles.DIR / tmpfsfiles.INDEX).read_text())
    assert index["version"] == 1


def test_put_back_writes_nothing_outside_tmpfs(tmp_path: Path) -> None:
    target = "/etc/gpusnap-test-not-tmpfs"
    (tmp_path / tmpfsfiles.DIR / "data").mkdir(parents=True)
    (tmp_path / tmpfsfiles.DIR / "data" / "0").write_bytes(b"x")
    entry = {"names": [target], "size": 1, "mode": 0o600, "uid": 0, "gid": 0, "data": "data/0"}
    (tmp_path / tmpfsfiles.DIR / tmpfsfiles.INDEX).write_text(
        json.dumps({"version": 1, "files": [entry]})
    )
    with pytest.raises(ValueError, match="not on a tmpfs"):
        tmpfsfiles.put_back(tmp_path)
    assert not Path(target).exists()
