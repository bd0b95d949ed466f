"""``daemon/host/openfiles.py`` and ``daemon/containers/openfiles.py`` on real files: CRIU
images written field by field as criu/images/{fdinfo,regfile,mnt}.proto lay them out, and real
tars of a rw layer. What the restore of a container does with them through real runtimes is in
tests/containers (``test_daemon_podman.py``, ``test_runc.py``); these pin each rule."""

from __future__ import annotations

import io
import logging
import os
import struct
import tarfile
from pathlib import Path

import pytest

from gpusnap.daemon.containers.openfiles import fit_tar
from gpusnap.daemon.host.criuimg import COMMON_MAGIC
from gpusnap.daemon.host.openfiles import fit_tree, recorded_sizes
from gpusnap.errors import Corrupt

FILES_MAGIC = 0x56303138
MNTS_MAGIC = 0x55563928
ROOT_MNT, BIND_MNT = 73, 75


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _image(magic: int, messages: list[bytes]) -> bytes:
    body = b"".join(struct.pack("<I", len(m)) + m for m in messages)
    return struct.pack("<II", COMMON_MAGIC, magic) + body


def _reg(fid: int, name: str, mnt: int, size: int | None, flags: int = 0o2) -> bytes:
    """A file_entry of type REG around its reg_file_entry (mnt_id is a zigzag sint32)."""
    reg = _field(1, fid) + _field(2, flags) + _field(3, 0) + _field(5, b"")
    reg += _field(6, name.encode()) + _field(7, mnt * 2)
    if size is not None:
        reg += _field(8, size)
    return _field(1, 1) + _field(2, fid) + _field(3, reg)


def _mount(mnt: int, mountpoint: str) -> bytes:
    return (
        _field(1, 17)
        + _field(2, mnt)
        + _field(3, 0)
        + _field(4, 1)
        + _field(5, 0)
        + (_field(6, b"/") + _field(7, mountpoint.encode()) + _field(8, b"overlay"))
    )


def _images(d: Path, files: list[bytes]) -> Path:
    d.mkdir()
    (d / "files.img").write_bytes(_image(FILES_MAGIC, files))
    mounts = [_mount(ROOT_MNT, "/"), _mount(BIND_MNT, "/out")]
    (d / "mountpoints-13.img").write_bytes(_image(MNTS_MAGIC, mounts))
    return d


def test_the_sizes_are_those_of_regular_files_on_the_root_mount_that_criu_recorded(
    tmp_path: Path,
) -> None:
    images = _images(
        tmp_path / "criu",
        [
            _reg(1, "/var/log/app.log", ROOT_MNT, 1478),
            _reg(2, "/usr/bin/python3.11", ROOT_MNT, 6834488),
            _reg(3, "/out/tokens", BIND_MNT, 99),  # a bind mount: not the rw layer
            _reg(4, "/var/log/append.log", ROOT_MNT, None),  # O_APPEND|O_WRONLY: no size
            _reg(5, "/../../etc/shadow", ROOT_MNT, 1),  # not a plain path: never followed
            _field(1, 2) + _field(2, 6),  # a pipe
        ],
    )
    assert recorded_sizes(images) == {"var/log/app.log": 1478, "usr/bin/python3.11": 6834488}
    assert recorded_sizes(tmp_path) == {}  # no files.img: nothing recorded


def test_images_that_cannot_be_read_are_corrupt(tmp_path: Path) -> None:
    images = _images(tmp_path / "criu", [_reg(1, "/a", ROOT_MNT, 5)])
    whole = (images / "files.img").read_bytes()
    (images / "files.img").write_bytes(whole[:-3])
    with pytest.raises(Corrupt, match="truncated"):
        recorded_sizes(images)
    (images / "files.img").write_bytes(struct.pack("<II", COMMON_MAGIC, MNTS_MAGIC))
    with pytest.raises(Corrupt, match="magic"):
        recorded_sizes(images)


def _layer(path: Path, members: dict[str, bytes], xattr: dict[str, str] | None = None) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        d = tarfile.TarInfo("var/log")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        t.addfile(d)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o640, 1_700_000_000
            if xattr and name in xattr:
                info.pax_headers = {"SCHILY.xattr.user.tag": xattr[name]}
            t.addfile(info, io.BytesIO(data))


def _read(path: Path) -> dict[str, tuple[bytes, int, int, dict[str, str]]]:
    with tarfile.open(path) as t:
        return {
            m.name: (
                t.extractfile(m).read() if m.isreg() else b"",  # type: ignore[union-attr]
                m.mode,
                int(m.mtime),
                {k: v for k, v in m.pax_headers.items() if k.startswith("SCHILY")},
            )
            for m in t
        }


def test_a_grown_file_is_cut_to_its_recorded_size_and_everything_else_is_kept_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grown = b"".join(b"%d line\n" % i for i in range(3000))  # past one tar block many times
    layer = tmp_path / "rootfs-diff.tar"
    members = {
        "var/log/app.log": grown,
        "etc/motd": b"hello\n",
        "var/log/shrunk.log": b"short",
        "long/" + "n" * 150 + "/name": b"a pax path",
    }
    _layer(layer, members, xattr={"var/log/app.log": "kept", "etc/motd": "also"})
    os.chmod(layer, 0o600)
    before = _read(layer)
    sizes = {"var/log/app.log": 4000, "etc/motd": 6, "var/log/shrunk.log": 10}

    with caplog.at_level(logging.WARNING):
        (fitted,) = fit_tar(layer, sizes)
    assert fitted.as_dict() == {
        "path": "/var/log/app.log",
        "bytes_stored": len(grown),
        "bytes_recorded": 4000,
    }
    after = _read(layer)
    assert after["var/log/app.log"] == (
        grown[:4000],
        0o640,
        1_700_000_000,
        {"SCHILY.xattr.user.tag": "kept"},
    )
    assert {k: v for k, v in after.items() if k != "var/log/app.log"} == {
        k: v for k, v in before.items() if k != "var/log/app.log"
    }
    # Shorter than recorded: nothing to cut it back to; left, and said.
    assert after["var/log/shrunk.log"][0] == b"short"
    assert "/var/log/shrunk.log is 5 bytes, 10 at the dump" in caplog.text
    assert layer.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*fitted"))

    # Already fitted: nothing is rewritten.
    mtime = layer.stat().st_mtime_ns
    assert fit_tar(layer, sizes) == []
    assert layer.stat().st_mtime_ns == mtime


def test_an_upper_directory_is_fitted_in_place_without_following_symlinks(
    tmp_path: Path,
) -> None:
    upper = tmp_path / "upper"
    (upper / "var/log").mkdir(parents=True)
    (upper / "var/log/app.log").write_bytes(b"x" * 100)
    (upper / "var/log/ok.log").write_bytes(b"y" * 10)
    outside = tmp_path / "host-file"
    outside.write_bytes(b"z" * 100)
    (upper / "etc").symlink_to(tmp_path)  # a symlink in the layer, pointing at the host
    sizes = {
        "var/log/app.log": 40,
        "var/log/ok.log": 10,
        "etc/host-file": 1,
        "var/log/absent.log": 1,  # the image's own file: not in the upper directory
    }
    (fitted,) = fit_tree(upper, sizes)
    assert (fitted.path, fitted.bytes_stored, fitted.bytes_recorded) == (
        "/var/log/app.log",
        100,
        40,
    )
    assert (upper / "var/log/app.log").read_bytes() == b"x" * 40
    assert (upper / "var/log/ok.log").read_bytes() == b"y" * 10
    assert outside.read_bytes() == b"z" * 100
