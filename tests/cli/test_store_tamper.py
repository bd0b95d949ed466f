"""Tampering with a store is refused with exit code 4 and leaves the destination clean."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from gpusnap.storage.keys import load_signing_key, seal
from gpusnap.storage.manifest import ENVELOPE_FORMAT
from tests.cli._cli import Cli, files_under, write_tree


@pytest.fixture
def pushed(cli: Cli, tmp_path: Path) -> str:
    image = tmp_path / "image"
    write_tree(image, big=4 * 1024 * 1024)
    checkpoint_id: str = cli.push(image, "victim")["checkpoint_id"]
    return checkpoint_id


def _store_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "store").rglob("*") if p.is_file()]


def _is_manifest(path: Path) -> bool:
    try:
        envelope = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(envelope, dict) and envelope.get("format") == ENVELOPE_FORMAT


def _manifest_file(tmp_path: Path, checkpoint_id: str) -> Path:
    found = [p for p in _store_files(tmp_path) if _is_manifest(p) and checkpoint_id in p.name]
    assert len(found) == 1, found
    return found[0]


def _largest_chunk_file(tmp_path: Path) -> Path:
    chunks = [p for p in (tmp_path / "store" / "chunks").rglob("*") if p.is_file()]
    return max(chunks, key=lambda p: p.stat().st_size)


def _assert_refused_cleanly(cli: Cli, checkpoint_id: str, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    before = {p.name for p in tmp_path.iterdir()}
    result = cli("store", "pull", checkpoint_id, str(dest))
    assert result.rc == 4, str(result)
    assert len(result.err.strip().splitlines()) == 1
    assert files_under(dest) == [], "a refused pull must not leave partial files"
    # No temp or partial file was left next to the destination either.
    assert {p.name for p in tmp_path.iterdir()} - before <= {"dest"}


def test_flipped_byte_in_a_chunk_fails_pull_and_read_data_verify(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    chunk = _largest_chunk_file(tmp_path)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))

    _assert_refused_cleanly(cli, pushed, tmp_path)
    verify = cli("store", "verify", "--all", "--read-data")
    assert verify.rc == 4, str(verify)
    verify_one = cli("store", "verify", pushed, "--read-data", "--json")
    assert verify_one.rc == 4
    assert verify_one.json()["problems"]


def test_edited_manifest_is_refused(cli: Cli, pushed: str, tmp_path: Path) -> None:
    path = _manifest_file(tmp_path, pushed)
    envelope = json.loads(path.read_bytes())
    body = json.loads(base64.b64decode(envelope["payload"]))
    body["workload"] = "someone-else"
    envelope["payload"] = base64.b64encode(json.dumps(body).encode()).decode()
    path.chmod(0o644)
    path.write_text(json.dumps(envelope))

    for argv in (["store", "show", pushed], ["store", "verify", pushed]):
        result = cli(*argv)
        assert result.rc == 4, str(result)
    _assert_refused_cleanly(cli, pushed, tmp_path)


def _resign_with_path(tmp_path: Path, checkpoint_id: str, evil_path: str) -> None:
    """Rewrite the manifest so one file is named ``evil_path``, validly signed by our key."""
    path = _manifest_file(tmp_path, checkpoint_id)
    envelope = json.loads(path.read_bytes())
    assert envelope["encryption"] == "none"
    body: dict[str, Any] = json.loads(base64.b64decode(envelope["payload"]))
    target = max(body["files"], key=lambda f: f["size"])
    target["path"] = evil_path
    signer = load_signing_key(tmp_path / "signing.key")
    blob = seal(
        ENVELOPE_FORMAT,
        json.dumps(body, sort_keys=True).encode(),
        signer=signer,
        encryption=None,
    )
    path.chmod(0o644)
    path.write_bytes(blob)


# One fixed path outside any test's directory (/tmp/gpusnap-escaped.img): its cases run on one
# xdist worker, one after the other.
@pytest.mark.xdist_group("tmp-escaped-img")
@pytest.mark.parametrize(
    "evil_path",
    ["../escaped.img", "sub/../../escaped.img", "/tmp/gpusnap-escaped.img"],
)
def test_manifest_naming_a_path_outside_dest_is_refused_and_writes_nothing(
    cli: Cli, pushed: str, tmp_path: Path, evil_path: str
) -> None:
    Path("/tmp/gpusnap-escaped.img").unlink(missing_ok=True)
    _resign_with_path(tmp_path, pushed, evil_path)
    dest = tmp_path / "dest"
    result = cli("store", "pull", pushed, str(dest))
    assert result.rc == 4, str(result)
    assert "path" in result.err
    assert files_under(dest) == []
    assert not (tmp_path / "escaped.img").exists()
    assert not Path("/tmp/gpusnap-escaped.img").exists()
    assert cli("store", "verify", pushed).rc == 4
