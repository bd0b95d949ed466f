"""Bad input and hostile stores: each test states the behaviour an operator is promised.

Written from a review that tried to break gpusnap with wrong arguments, a hostile store and a
second daemon on the same state dir. Each test asserts the *expected* behaviour (one clear
line, a documented exit code, nothing lost, nothing written outside gpusnap's directories).
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from gpusnap.storage.keys import load_signing_key, seal
from gpusnap.storage.manifest import ENVELOPE_FORMAT
from tests.cli._cli import Cli, files_under, make_cli, write_tree
from tests.support.daemons import BIN, Nodes, gpusnapd
from tests.support.mounts import tmpfs

EXIT_USAGE = 2
EXIT_INTEGRITY = 4


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return make_cli(tmp_path)


@pytest.fixture
def pushed(cli: Cli, tmp_path: Path) -> str:
    image = tmp_path / "image"
    write_tree(image, big=1024 * 1024)
    checkpoint_id: str = cli.push(image, "victim")["checkpoint_id"]
    return checkpoint_id


def _manifest_path(tmp_path: Path, checkpoint_id: str) -> Path:
    found = list((tmp_path / "store" / "manifests").glob(f"*/{checkpoint_id}"))
    assert len(found) == 1, found
    return found[0]


def _manifest_body(tmp_path: Path, checkpoint_id: str) -> dict[str, Any]:
    envelope = json.loads(_manifest_path(tmp_path, checkpoint_id).read_bytes())
    body: dict[str, Any] = json.loads(base64.b64decode(envelope["payload"]))
    return body


def _resign(tmp_path: Path, checkpoint_id: str, body: dict[str, Any]) -> None:
    """Write ``body`` as the manifest, validly signed: only what validation catches is left."""
    path = _manifest_path(tmp_path, checkpoint_id)
    signer = load_signing_key(tmp_path / "signing.key")
    blob = seal(ENVELOPE_FORMAT, json.dumps(body).encode(), signer=signer, encryption=None)
    path.chmod(0o644)
    path.write_bytes(blob)


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


# --- ids and names ----------------------------------------------------------------------------


def test_checkpoint_id_with_a_trailing_newline_is_a_usage_error(cli: Cli, pushed: str) -> None:
    # The id regex must match the whole string; '$' also matches before a final newline.
    result = cli("store", "show", pushed + "\n")
    assert result.rc == EXIT_USAGE, str(result)


def test_a_stray_manifest_name_with_a_newline_does_not_break_listing(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    manifest = _manifest_path(tmp_path, pushed)
    stray = manifest.with_name(manifest.name + "\n")
    stray.write_bytes(manifest.read_bytes())
    result = cli("store", "ls", "--json")
    assert result.rc == 0, str(result)
    assert pushed in [c["checkpoint_id"] for c in result.json()["checkpoints"]]
    # gc must still work (it may keep everything, but must not fail as a usage error).
    result = cli("store", "gc", "--dry-run")
    assert result.rc != EXIT_USAGE, str(result)


def test_pull_into_an_empty_destination_argument_is_a_usage_error(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "gpusnap.cli.main", "store", "pull", pushed, ""],
        env=cli.environ(),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == EXIT_USAGE, proc
    assert files_under(cwd) == [], "an empty DEST must not mean the current directory"


# --- hostile chunks and manifests -------------------------------------------------------------


def _small_chunk(tmp_path: Path, checkpoint_id: str) -> tuple[str, Path]:
    body = _manifest_body(tmp_path, checkpoint_id)
    entry = next(f for f in body["files"] if f["path"] == "run.sh")
    chunk_id = entry["chunks"][0][0]
    return chunk_id, tmp_path / "store" / "chunks" / chunk_id[:2] / chunk_id


def test_chunk_header_claiming_more_than_the_manifest_is_refused_as_corrupt(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    # A tiny object whose header claims 1 TiB: must be refused by comparing with the size the
    # signed manifest declares, before anything is allocated or decompressed.
    _chunk_id, path = _small_chunk(tmp_path, pushed)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"x")
    header = struct.pack("<4sBBHQ", b"GSNC", 1, 1, 0, 1 << 40)
    path.chmod(0o644)
    path.write_bytes(header + frame)
    dest = tmp_path / "dest"
    result = cli("store", "pull", pushed, str(dest))
    assert result.rc == EXIT_INTEGRITY, str(result)
    assert _one_line(result.err)
    assert files_under(dest) == []
    result = cli("store", "verify", pushed, "--read-data")
    assert result.rc == EXIT_INTEGRITY, str(result)
    assert "internal error" not in result.err


def test_one_chunk_declared_with_two_sizes_is_refused(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    body = _manifest_body(tmp_path, pushed)
    small = next(f for f in body["files"] if f["path"] == "run.sh")
    chunk_id, real = small["chunks"][0]
    # Listed first with a larger size, then (run.sh) with its real one.
    body["files"].insert(
        0, {"path": "aaa", "size": real + 7, "mode": 0o644, "chunks": [[chunk_id, real + 7]]}
    )
    _resign(tmp_path, pushed, body)
    dest = tmp_path / "dest"
    result = cli("store", "pull", pushed, str(dest))
    assert result.rc == EXIT_INTEGRITY, str(result)
    assert files_under(dest) == []


def test_gc_that_skips_its_sweep_says_so_in_its_exit_code(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    bad = _manifest_path(tmp_path, pushed).with_name("20200101T000000Z-0123456789")
    bad.write_bytes(b"{not json")
    result = cli("store", "gc", "--grace", "0s")
    assert result.rc != 0, "a gc that deleted nothing because of a bad manifest must not exit 0"


def test_pushing_never_writes_through_a_symlinked_store_directory(cli: Cli, tmp_path: Path) -> None:
    store = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    store.mkdir(exist_ok=True)
    (store / "chunks").symlink_to(outside)
    image = tmp_path / "image"
    write_tree(image, big=64 * 1024)
    cli("store", "push", str(image), "--workload", "w")
    assert list(outside.iterdir()) == [], "the store wrote outside its directory"


# --- local disk -------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small", "size=1m") as mnt:
        yield mnt


def test_pull_onto_a_full_disk_is_not_a_usage_error(
    cli: Cli, pushed: str, small_tmpfs: Path
) -> None:
    dest = small_tmpfs / "dest"
    result = cli("store", "pull", pushed, str(dest))
    assert result.rc == 1, str(result)
    assert _one_line(result.err)
    assert files_under(small_tmpfs) == []


# --- the daemon -------------------------------------------------------------------------------


def _check_config(node_cfg: Path) -> subprocess.CompletedProcess[str]:
    return gpusnapd("--config", str(node_cfg), "--check-config")


@pytest.mark.parametrize(
    "store_section",
    [
        'url = "file:///tmp/gpusnap-badinput-store"\nkey_file = "/nonexistent/signing.key"\n',
        'url = "ftp://example.com/x"\nkey_file = "{key}"\n',
    ],
    ids=["missing-key-file", "unknown-store-scheme"],
)
def test_daemon_refuses_a_config_whose_store_section_cannot_work(
    nodes: Nodes, store_section: str
) -> None:
    node = nodes.make("a")
    node.write_config(store_section.format(key=nodes.key_file))
    result = _check_config(node.config_path)
    assert result.returncode == EXIT_USAGE, result
    assert "store" in result.stderr


def test_a_second_daemon_on_the_same_state_dir_leaves_the_first_ones_staging_alone(
    nodes: Nodes,
) -> None:
    first = nodes.make("a").start()
    # What an in-flight checkpoint of the first daemon looks like on disk.
    in_flight = first.state_dir / "staging" / "20991231T235959-abcdef"
    (in_flight / "images").mkdir(parents=True)
    (in_flight / "images" / "pages-1.img").write_bytes(b"the only copy of a workload")
    proc = gpusnapd("--config", str(first.config_path))
    assert proc.returncode != 0, "a second daemon on one socket must not start"
    time.sleep(0.2)
    assert (in_flight / "images" / "pages-1.img").exists(), (
        "a daemon that could not start deleted the running daemon's staging"
    )
    assert first.cli("status").rc == 0


def test_a_pid_too_large_for_the_api_is_a_usage_error(nodes: Nodes) -> None:
    node = nodes.make("a").start()
    result = node.cli("checkpoint", "--pid", "99999999999999999999")
    assert result.rc == EXIT_USAGE, result
    assert "internal error" not in result.stderr


def test_a_socket_path_too_long_is_one_line(tmp_path: Path) -> None:
    sock = "/tmp/" + "s" * 150 + "/gpusnapd.sock"
    proc = subprocess.run(
        [str(BIN / "gpusnap"), "--socket", sock, "status"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode in (EXIT_USAGE, 5), proc
    assert _one_line(proc.stderr), proc.stderr
