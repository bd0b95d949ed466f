"""What the store-check tests read of a daemon and of its store: the daemon's ``store_check``
status, waited on; and, as any other reader of the store would, a checkpoint's chunks and the
entries that went up as streams, and a verify of every chunk's bytes
(tests/e2e/test_store_check.py for a process tree, tests/containers/test_store_check_podman.py
for a container)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.storage import open_store
from gpusnap.storage.streams import stream_kinds
from tests.support.daemons import HANG_GUARD, Node, Result


def until(what: str, ready: Callable[[], Any], node: Node) -> Any:
    """What ``ready()`` returns once it is true (``TimeoutError`` with the daemon's log)."""
    end = time.monotonic() + HANG_GUARD
    while not (got := ready()):
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: {node.log()}")
        time.sleep(0.05)
    return got


def store_check(node: Node) -> dict[str, Any]:
    """``gpusnap status --json``'s ``store_check``."""
    got = node.cli("status", "--json")
    assert got.rc == 0, got.stderr
    check: dict[str, Any] = got.json["store_check"]
    return check


@dataclass(frozen=True)
class StoreReader:
    """The daemon's store opened by another reader (its own chunk cache)."""

    url: str
    key_file: Path
    cache_dir: Path

    def chunks(self, checkpoint_id: str) -> dict[str, str]:
        """Chunk id -> the file that names it, of one checkpoint."""
        with open_store(self.url, key_file=self.key_file, cache_dir=self.cache_dir) as store:
            return {c.id: f.path for f in store.manifest(checkpoint_id).files for c in f.chunks}

    def stream_kinds(self, checkpoint_id: str) -> set[str]:
        """The kinds of the checkpoint's entries that went up as streams
        (``storage/streams.py``: page images or container parts uploaded during the dump)."""
        with open_store(self.url, key_file=self.key_file, cache_dir=self.cache_dir) as store:
            return set(stream_kinds(store.manifest(checkpoint_id)).values())

    def verify_all(self, node: Node) -> Result:
        """``gpusnap store verify --all --read-data`` of the store, run by ``node``'s CLI."""
        return node.cli(
            "store",
            "verify",
            "--all",
            "--read-data",
            "--store",
            self.url,
            "--key-file",
            str(self.key_file),
            "--cache-dir",
            str(self.cache_dir),
        )
