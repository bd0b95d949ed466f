"""A store holding hostile objects, through the real ``gpusnap`` and ``gpusnapd``: every command
gives one line and a documented exit code, and the daemon starts and serves (a bad store is a
status, not a crash)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli._cli import Cli, image_tree, make_cli
from tests.support.daemons import Nodes

EXIT_INTEGRITY = 4
# Deep enough to exhaust the interpreter's stack in any recursive parser.
NESTED = b"[" * 100_000 + b"]" * 100_000
# Parsed, a lone surrogate that fails wherever it is encoded (printed, hashed, sent).
SURROGATE = (
    b'{"format":"gpusnap.manifest/1","encryption":"none","payload":"","signature":"AA==",'
    b'"key_id":"\\ud800\\u001b[2J"}'
)
HOSTILE = {"nested": NESTED, "lone-surrogate": SURROGATE}


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return make_cli(tmp_path)


@pytest.fixture
def pushed(cli: Cli, tmp_path: Path) -> Iterator[str]:
    cid: str = cli.push(image_tree(tmp_path), "w")["checkpoint_id"]
    yield cid


@pytest.mark.parametrize("blob", HOSTILE.values(), ids=HOSTILE.keys())
def test_store_commands_on_a_hostile_manifest_are_one_line_and_exit_4(
    cli: Cli, pushed: str, tmp_path: Path, blob: bytes
) -> None:
    (tmp_path / "store" / "manifests" / "w" / pushed).write_bytes(blob)
    for args in (
        ("store", "ls"),
        ("store", "verify", "--all"),
        ("store", "gc"),
        ("store", "show", pushed),
        ("store", "pull", pushed, str(tmp_path / "out")),
    ):
        result = cli(*args)  # asserts there is no traceback
        assert result.rc == EXIT_INTEGRITY, str(result)
        assert _one_line(result.err), str(result)
        assert "\x1b" not in result.err, str(result)


@pytest.mark.parametrize("blob", HOSTILE.values(), ids=HOSTILE.keys())
def test_store_commands_on_a_hostile_store_config_still_work(
    cli: Cli, pushed: str, tmp_path: Path, blob: bytes
) -> None:
    (tmp_path / "store" / "config").write_bytes(blob)
    listing = cli("store", "ls", "--json")
    assert listing.rc == 0, str(listing)
    assert [c["checkpoint_id"] for c in listing.json()["checkpoints"]] == [pushed]
    cli.ok("store", "pull", pushed, str(tmp_path / "out"))
    verify = cli("store", "verify", "--all")
    assert verify.rc == EXIT_INTEGRITY, str(verify)
    assert _one_line(verify.err), str(verify)


@pytest.mark.parametrize("blob", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_daemon_starts_and_serves_whatever_the_store_holds(
    nodes: Nodes, tmp_path: Path, blob: bytes
) -> None:
    checkpoint_id = "20261130T083000Z-0123456789"
    (nodes.store_dir / "manifests" / "w").mkdir(parents=True)
    (nodes.store_dir / "config").write_bytes(blob)
    (nodes.store_dir / "manifests" / "w" / checkpoint_id).write_bytes(blob)
    node = nodes.make("a").start()  # raises if it exits or never serves
    status = node.cli("status", "--json")
    assert status.rc == 0, status
    # The daemon's listing leaves out what fails its checks (and logs it), as for any
    # manifest that does not authenticate.
    listing = node.cli("ls", "--json")
    assert listing.rc == 0 and checkpoint_id not in listing.stdout, listing
    for args in (("show", checkpoint_id), ("restore", "--workload", "w", "--latest", "--wait")):
        result = node.cli(*args)
        assert "Traceback" not in result.stderr, result
        assert result.rc in (EXIT_INTEGRITY, 3), result  # 3: nothing authentic to restore
        assert _one_line(result.stderr), result
        assert "\x1b" not in result.stderr, result
    assert node.cli("status").rc == 0
