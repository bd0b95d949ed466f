"""One gpusnapd per state dir: the lock, and state dirs that cannot be used, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.infra.statedir import LOCK_NAME, StateDirLock
from gpusnap.errors import FailedPrecondition, InvalidArgument
from tests.support.mounts import tmpfs

# Tries to take the lock from another process; prints "locked" or the error's one line.
_OTHER = """
import sys
from pathlib import Path
from gpusnap.daemon.infra.statedir import StateDirLock
from gpusnap.errors import GpusnapError
try:
    StateDirLock.acquire(Path(sys.argv[1]), Path(sys.argv[2]) if sys.argv[2] else None)
except GpusnapError as err:
    print(f"{type(err).__name__}: {err}")
else:
    print("locked")
"""


def _other_process(state_dir: Path, staging_dir: Path | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER, str(state_dir), str(staging_dir or "")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return proc.stdout.strip()


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"


def test_a_second_holder_is_refused_naming_the_first_ones_pid(state_dir: Path) -> None:
    lock = StateDirLock.acquire(state_dir)
    try:
        assert (state_dir / LOCK_NAME).read_text().strip() == str(os.getpid())
        assert oct(state_dir.stat().st_mode & 0o777) == oct(0o700)
        answer = _other_process(state_dir)
        assert answer.startswith(
            f"FailedPrecondition: another gpusnapd (pid {os.getpid()}) holds {state_dir};"
        )
        # In this process too (flock is per open file, not per process).
        with pytest.raises(FailedPrecondition, match="another gpusnapd"):
            StateDirLock.acquire(state_dir)
    finally:
        lock.release()
    assert _other_process(state_dir) == "locked"


def test_a_separate_staging_dir_is_locked_too(tmp_path: Path, state_dir: Path) -> None:
    staging = tmp_path / "shm-staging"
    lock = StateDirLock.acquire(state_dir, staging)
    try:
        # Another daemon with its own state dir but the same staging dir would clean ours.
        answer = _other_process(tmp_path / "other-state", staging)
        assert answer.startswith(f"FailedPrecondition: another gpusnapd holds {staging};"), answer
        assert "[daemon] staging_dir" in answer
        assert list(staging.iterdir()) == [], "nothing is added to a staging dir"
    finally:
        lock.release()
    assert _other_process(tmp_path / "other-state", staging) == "locked"


def test_processes_the_daemon_starts_never_hold_its_lock(state_dir: Path) -> None:
    # Restored trees, cold starts and CRIU outlive or run beside the daemon: if they inherited
    # the lock, a restarted daemon would find its own state dir taken.
    lock = StateDirLock.acquire(state_dir)
    child = subprocess.Popen(["sleep", "300"], close_fds=False)
    try:
        lock.release()
        assert _other_process(state_dir) == "locked"
    finally:
        child.kill()
        child.wait()


def test_a_state_dir_that_is_a_file_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(InvalidArgument) as info:
        StateDirLock.acquire(afile)
    assert str(info.value) == f"config: [daemon] state_dir: {afile} exists and is not a directory"
    with pytest.raises(InvalidArgument) as info:
        StateDirLock.acquire(afile / "state")
    assert str(info.value) == (
        f"config: [daemon] state_dir: cannot create {afile / 'state'}: "
        "a part of the path is a file, not a directory"
    )


def test_a_state_dir_on_a_read_only_file_system_is_said_in_words(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mnt, pytest.raises(InvalidArgument) as info:
        StateDirLock.acquire(mnt / "state")
    assert str(info.value) == (
        f"config: [daemon] state_dir: cannot create {mnt / 'state'}: "
        "it is on a read-only file system"
    )
