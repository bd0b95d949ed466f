"""A runtime's checkpoint archive unpacked from a pipe (``containers.archive.unpack_stream``):
real tar streams through a real pipe; files and directories only, inside the destination."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from pathlib import Path

import pytest

from gpusnap.daemon.containers.archive import unpack_stream
from gpusnap.errors import Corrupt


def _tar(members: list[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            t.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


def _file(name: str, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info


def _through_a_pipe(data: bytes, dest: Path) -> tuple[int, list[tuple[str, int]]]:
    r, w = os.pipe()
    seen: list[tuple[str, int]] = []

    def write() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        return unpack_stream(r, dest, on_file=lambda p, n: seen.append((p, n))), seen
    finally:
        os.close(r)
        writer.join(60)


def test_files_and_directories_arrive_whole_and_are_announced_in_order(tmp_path: Path) -> None:
    big = os.urandom(3 << 20) + b"tail"  # more than one splice, not a multiple of a block
    long_name = "checkpoint/" + "d" * 120 + "/pages-1.img"  # a PAX path
    directory = tarfile.TarInfo("checkpoint")
    directory.type = tarfile.DIRTYPE
    data = _tar(
        [
            (directory, b""),
            (_file("checkpoint/pages-1.img"), big),
            (_file(long_name), b"x" * 700),
            (_file("config.dump", 0o4755), b"{}"),
            (_file("empty"), b""),
        ]
    )
    n, seen = _through_a_pipe(data, tmp_path)
    assert n == 5
    assert seen == [
        ("checkpoint/pages-1.img", len(big)),
        (long_name, 700),
        ("config.dump", 2),
        ("empty", 0),
    ]
    assert (tmp_path / "checkpoint/pages-1.img").read_bytes() == big
    assert (tmp_path / long_name).read_bytes() == b"x" * 700
    assert (tmp_path / "empty").read_bytes() == b""
    assert (tmp_path / "config.dump").stat().st_mode & 0o7777 == 0o700  # no setuid, ours only


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("../escape", tarfile.REGTYPE),
        ("a/../../escape", tarfile.REGTYPE),
        ("link", tarfile.SYMTYPE),
    ],
)
def test_a_member_outside_the_directory_or_not_a_file_is_corrupt(
    tmp_path: Path, name: str, kind: bytes
) -> None:
    info = _file(name)
    info.type = kind
    info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(Corrupt, match="checkpoint archive"):
        _through_a_pipe(_tar([(info, b"data" if kind == tarfile.REGTYPE else b"")]), dest)
    assert not (tmp_path / "escape").exists() and not (dest / "link").exists()


def test_an_absolute_name_lands_inside_the_directory(tmp_path: Path) -> None:
    # tarfile's data filter, as GNU tar: the leading "/" goes, the rest stays inside.
    n, seen = _through_a_pipe(_tar([(_file("/etc/gpusnap-owned"), b"x")]), tmp_path)
    assert (n, seen) == (1, [("etc/gpusnap-owned", 1)])
    assert (tmp_path / "etc/gpusnap-owned").read_bytes() == b"x"
    assert not Path("/etc/gpusnap-owned").exists()


def test_a_stream_cut_short_is_corrupt(tmp_path: Path) -> None:
    data = _tar([(_file("pages-1.img"), os.urandom(100_000))])
    with pytest.raises(Corrupt, match=r"truncated in pages-1\.img"):
        _through_a_pipe(data[:50_000], tmp_path)
    with pytest.raises(Corrupt, match="truncated in a header"):
        _through_a_pipe(data[:300], tmp_path / "x")
