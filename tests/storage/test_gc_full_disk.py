"""gc on a store whose disk is 100% full: the space reserve lets it record itself and run.

The full-disk cases use a real small tmpfs (ENOSPC is the kernel's, not a mock) and the real
CLI as a subprocess, the way an operator runs gc when the disk has filled.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.errors import InvalidArgument
from gpusnap.storage.backend import release_space_reserve, restore_space_reserve
from gpusnap.storage.file_backend import RESERVE_BYTES
from gpusnap.storage.layout import RESERVE_NAME
from gpusnap.storage.locks import GC_RECORD_FORMAT
from gpusnap.storage.open import open_backend
from tests.cli._cli import Cli, make_cli, write_tree
from tests.storage.store_helpers import MiB, StoreUnderTest, fast_options, mounted_tmpfs

# Three ~3 MiB checkpoints, the 4 MiB reserve, and room left over for the filler.
DISK_SIZE = "24m"


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", DISK_SIZE) as mount_point:
        yield mount_point


@pytest.fixture
def cli(tmp_path: Path, disk: Path) -> Cli:
    # Keys and the chunk index stay on tmp_path: only the store is on the small disk.
    return make_cli(tmp_path, f"file://{disk / 'store'}")


def _push_three(cli: Cli, tmp_path: Path) -> list[str]:
    ids = []
    for seed in range(3):
        image = tmp_path / f"image-{seed}"
        write_tree(image, seed=seed)
        ids.append(cli.push(image, "llama")["checkpoint_id"])
    return ids


def _fill(disk: Path) -> None:
    """Write filler beside the store until the filesystem has not one free block."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for block in (1 * MiB, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\xff" * block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0


@pytest.fixture
def full_disk(cli: Cli, disk: Path, tmp_path: Path) -> list[str]:
    """Three checkpoints of one workload pushed, then the disk filled to the last block."""
    ids = _push_three(cli, tmp_path)
    _assert_reserve_held(disk / "store")
    _fill(disk)
    return ids


def _manifest_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "manifests").rglob("*") if p.is_file())


def _assert_reserve_held(store: Path) -> None:
    st = os.stat(store / RESERVE_NAME, follow_symlinks=False)
    assert stat.S_ISREG(st.st_mode)
    assert st.st_blocks * 512 >= RESERVE_BYTES  # real blocks, not a hole


def test_gc_runs_on_a_full_disk_frees_space_and_puts_the_reserve_back(
    cli: Cli, disk: Path, full_disk: list[str]
) -> None:
    store, ids = disk / "store", full_disk
    report = cli.ok("store", "gc", "--keep-last", "1", "--grace", "0s", "--json").json()

    assert report["reserve_released"] is True
    assert report["reserve_missing"] is False
    assert sorted(report["manifests_deleted"]) == sorted(ids[:2])
    assert report["chunks_deleted"] > 0 and report["bytes_freed"] > 2 * MiB
    assert report["problems"] == []
    assert cli.ids() == [ids[2]]
    assert os.statvfs(disk).f_bavail > 0
    _assert_reserve_held(store)
    verify = cli.ok("store", "verify", "--all", "--json")
    assert RESERVE_NAME not in verify.out
    listing = cli.ok("store", "ls", "--json")
    assert RESERVE_NAME not in listing.out
    # The gc recorded itself, finished, and left no temp file behind.
    records = list((store / "locks").glob("gc-*"))
    assert len(records) == 1
    envelope = json.loads(records[0].read_bytes())  # signed, not encrypted (no key given)
    assert envelope["format"] == GC_RECORD_FORMAT and envelope["signature"]
    record = json.loads(base64.b64decode(envelope["payload"]))
    assert record["swept"] is True and record["finished_at"] is not None
    assert not [p for p in store.rglob("*") if p.name.startswith(".gpusnap-tmp")]


def test_gc_on_a_full_disk_says_it_used_the_reserve(cli: Cli, full_disk: list[str]) -> None:
    result = cli.ok("store", "gc", "--keep-last", "1", "--grace", "0s")
    assert "space reserve" in result.out
    assert "warning" not in result.out


def test_a_push_on_a_full_disk_fails_cleanly_and_leaves_the_reserve(
    cli: Cli, disk: Path, tmp_path: Path, full_disk: list[str]
) -> None:
    store, ids = disk / "store", full_disk
    manifests = _manifest_files(store)
    image = tmp_path / "image-new"
    write_tree(image, seed=99)

    result = cli("store", "push", str(image), "--workload", "llama")

    assert result.rc == 1, str(result)
    assert "disk full" in result.err
    assert len(result.err.strip().splitlines()) == 1
    assert _manifest_files(store) == manifests
    assert cli.ids() == list(reversed(ids))
    _assert_reserve_held(store)  # a push never spends it
    assert os.statvfs(disk).f_bavail == 0


def test_gc_without_its_reserve_on_a_full_disk_deletes_nothing(
    cli: Cli, disk: Path, tmp_path: Path
) -> None:
    store = disk / "store"
    ids = _push_three(cli, tmp_path)
    os.unlink(store / RESERVE_NAME)
    _fill(disk)
    before = sorted(p for p in store.rglob("*") if p.is_file())

    result = cli("store", "gc", "--keep-last", "1", "--grace", "0s")

    assert result.rc == 1, str(result)
    assert "gc cannot record itself" in result.err and "space reserve" in result.err
    assert sorted(p for p in store.rglob("*") if p.is_file()) == before
    assert cli.ids() == list(reversed(ids))


def test_gc_after_freeing_space_by_hand_recreates_a_missing_reserve(
    cli: Cli, disk: Path, tmp_path: Path
) -> None:
    store = disk / "store"
    _push_three(cli, tmp_path)
    os.unlink(store / RESERVE_NAME)
    report = cli.ok("store", "gc", "--keep-last", "1", "--grace", "0s", "--json").json()
    assert report["reserve_released"] is False
    assert report["reserve_missing"] is False
    _assert_reserve_held(store)


# -- the reserve in the file backend ------------------------------------------------------


def test_first_write_makes_the_reserve_which_no_key_names_and_no_listing_shows(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    backend = open_backend(f"file://{root}", fast_options())
    assert not (root / RESERVE_NAME).exists()  # opening writes nothing
    backend.put("chunks/aa/bb", b"data")
    _assert_reserve_held(root)
    assert stat.S_IMODE((root / RESERVE_NAME).stat().st_mode) == 0o600
    assert [info.key for info in backend.list()] == ["chunks/aa/bb"]
    assert list(backend.list(".gpusnap")) == []
    for call in (backend.get, backend.stat, backend.delete):
        with pytest.raises(InvalidArgument):
            call(RESERVE_NAME)
    with pytest.raises(InvalidArgument):
        backend.put(RESERVE_NAME, b"x")
    assert (root / RESERVE_NAME).stat().st_size == RESERVE_BYTES


def test_release_and_restore_reserve(tmp_path: Path) -> None:
    root = tmp_path / "store"
    backend = open_backend(f"file://{root}", fast_options())
    backend.put("locks/x", b"1")
    assert release_space_reserve(backend) is True
    assert not (root / RESERVE_NAME).exists()
    assert release_space_reserve(backend) is False  # nothing left to free
    backend.put("locks/y", b"2")  # a later put does not take it back (only gc does)
    assert not (root / RESERVE_NAME).exists()
    assert restore_space_reserve(backend) is True
    _assert_reserve_held(root)


def test_a_reserve_that_is_a_symlink_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the store's")
    (root / RESERVE_NAME).symlink_to(outside)
    backend = open_backend(f"file://{root}", fast_options())

    backend.put("chunks/aa/bb", b"data")
    assert release_space_reserve(backend) is False
    assert restore_space_reserve(backend) is False

    assert (root / RESERVE_NAME).is_symlink()
    assert outside.read_bytes() == b"not the store's"
    assert [info.key for info in backend.list()] == ["chunks/aa/bb"]


def test_a_backend_without_a_reserve_makes_it_a_no_op(store: StoreUnderTest) -> None:
    store.backend.put("locks/x", b"1")
    released = release_space_reserve(store.backend)
    assert released is (store.kind == "file")
    assert restore_space_reserve(store.backend) is True
    assert [info.key for info in store.backend.list()] == ["locks/x"]
