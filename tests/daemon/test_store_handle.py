"""The daemon's store handle with the node's chunk cache: opened together, a broken cache never
keeps the store from opening, and ``warmth`` says how much of a checkpoint is held here."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from gpusnap.daemon.config.file import Config, parse_config
from gpusnap.daemon.node.node import StoreHandle
from gpusnap.storage import generate_signing_key, open_store


def _config(tmp_path: Path, cache: dict[str, object] | None = None) -> Config:
    key = tmp_path / "signing.key"
    if not key.exists():
        generate_signing_key(key)
    return parse_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state")},
            "store": {"url": f"file://{tmp_path / 'store'}", "key_file": str(key)},
            **({"cache": cache} if cache is not None else {}),
        }
    )


def _image(tmp_path: Path, name: str, data: bytes) -> Path:
    src = tmp_path / name
    src.mkdir()
    (src / "pages-1.img").write_bytes(data)
    return src


def test_the_store_opens_with_the_node_cache_in_the_state_dir(tmp_path: Path) -> None:
    handle = StoreHandle(_config(tmp_path, {"max_bytes": 64 << 20}))
    try:
        store = handle.get()
        assert store.cache is not None and handle.cache is not None
        assert handle.cache.dir == tmp_path / "state" / "cache"
        assert handle.cache.max_bytes == 64 << 20
        assert handle.cache_error is None
    finally:
        handle.close()


def test_a_cache_that_cannot_be_opened_leaves_the_store_working_without_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # anyone may write into it: the daemon (root) must not use it
    handle = StoreHandle(_config(tmp_path, {"dir": str(shared)}))
    try:
        with caplog.at_level(logging.WARNING, logger="gpusnap.daemon.node.node"):
            store = handle.get()
        assert store.cache is None and handle.cache is None
        assert handle.cache_error is not None and str(shared) in handle.cache_error
        assert any("chunk cache not used" in r.getMessage() for r in caplog.records)
        pushed = store.push(_image(tmp_path, "img", b"x" * 100_000), workload="w")
        pulled = store.pull(pushed.checkpoint_id, tmp_path / "out")
        assert (pulled.bytes_fetched > 0, pulled.bytes_cached) == (True, 0)
        assert handle.warmth(pushed.checkpoint_id) is None  # no cache: nothing to say
    finally:
        handle.close()


def test_a_disabled_cache_is_not_made(tmp_path: Path) -> None:
    handle = StoreHandle(_config(tmp_path, {"enabled": False}))
    try:
        assert handle.get().cache is None
        assert not (tmp_path / "state" / "cache" / "chunks.sqlite").exists()
    finally:
        handle.close()


def test_warmth_counts_what_a_restore_would_fetch_that_the_cache_holds(tmp_path: Path) -> None:
    config = _config(tmp_path, {"max_bytes": 256 << 20})
    # Another node pushes (nothing of it in this node's cache).
    with open_store(
        config.store.url, key_file=config.store.key_file, cache_dir=tmp_path / "other"
    ) as other:
        data = random.Random(1).randbytes(3 << 20)  # no chunk twice, none all zeros
        first = other.push(_image(tmp_path, "one", data), workload="w")
    handle = StoreHandle(config)
    try:
        cold = handle.warmth(first.checkpoint_id)
        assert cold is not None
        assert (cold["bytes_warm"], cold["fraction"]) == (0, 0.0)
        assert cold["bytes_total"] == len(data)
        handle.get().prefetch(first.checkpoint_id)
        warm = handle.warmth(first.checkpoint_id)
        assert warm == {**cold, "bytes_warm": cold["bytes_total"], "fraction": 1.0}
    finally:
        handle.close()
