"""The standby's prefetch follower over a real ``file://`` store and a real chunk cache: it
follows each workload's newest authentic checkpoint, once, and says how warm it is."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.reclaim.prefetch import PrefetchFollower
from gpusnap.errors import Unavailable
from gpusnap.storage import ChunkCache, generate_signing_key, open_store
from gpusnap.storage.layout import manifest_key
from gpusnap.storage.manifest import new_checkpoint_id
from gpusnap.storage.store import CheckpointStore
from tests.storage.store_helpers import MiB, random_bytes

pytestmark = pytest.mark.timeout(120)


class Access:
    """The daemon's store handle, as reclaim sees it (``StoreAccess``)."""

    def __init__(self, store: CheckpointStore | None) -> None:
        self.store = store

    def get(self) -> CheckpointStore:
        if self.store is None:
            raise Unavailable("store unreachable (test)")
        return self.store


def _push(store: CheckpointStore, tmp_path: Path, workload: str, seed: int) -> str:
    src = tmp_path / f"src-{workload}-{seed}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(random_bytes(3 * MiB, seed))
    return store.push(src, workload=workload).checkpoint_id


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[CheckpointStore, CheckpointStore]]:
    """(the pushing node's store, the standby's store on the same URL with its own cache)."""
    key = tmp_path / "signing.key"
    generate_signing_key(key)
    url = f"file://{tmp_path / 'store'}"
    cache = ChunkCache(tmp_path / "standby-cache", max_bytes=256 * MiB)
    with (
        open_store(url, key_file=key, cache_dir=tmp_path / "idx-a") as source,
        open_store(url, key_file=key, cache_dir=tmp_path / "idx-b", chunk_cache=cache) as standby,
    ):
        yield source, standby
    cache.close()


def test_it_follows_each_workloads_newest_checkpoint_once(
    stores: tuple[CheckpointStore, CheckpointStore], tmp_path: Path
) -> None:
    source, standby = stores
    follower = PrefetchFollower(
        Access(standby), ["llm", "tts", "idle"], bandwidth=1e9, poll_interval_s=1.0
    )
    llm_1 = _push(source, tmp_path, "llm", 1)
    tts_1 = _push(source, tmp_path, "tts", 2)
    done = follower.tick()
    assert sorted(r.checkpoint_id for r in done) == sorted([llm_1, tts_1])
    assert all(r.bytes_fetched > 0 and r.warm_fraction == 1.0 for r in done)
    assert standby.warm_fraction(llm_1) == 1.0 and standby.warm_fraction(tts_1) == 1.0

    assert follower.tick() == []  # nothing new: nothing fetched, no manifest read

    # Likely within the same second as llm_1 (ids then order by chance): still the newest.
    llm_2 = _push(source, tmp_path, "llm", 3)
    (again,) = follower.tick()
    assert again.checkpoint_id == llm_2 and again.warm_fraction == 1.0
    state = {w["workload"]: w for w in follower.state()["workloads"]}
    assert state["llm"]["checkpoint_id"] == llm_2
    assert state["llm"]["warm_fraction"] == 1.0
    assert state["llm"]["bytes_fetched"] == again.bytes_fetched
    assert state["tts"]["checkpoint_id"] == tts_1
    assert state["idle"]["checkpoint_id"] is None and state["idle"]["warm_fraction"] is None


def test_a_forged_newer_manifest_is_skipped_for_the_newest_authentic_one(
    stores: tuple[CheckpointStore, CheckpointStore], tmp_path: Path
) -> None:
    source, standby = stores
    real = _push(source, tmp_path, "llm", 1)
    forged = new_checkpoint_id(time.time() + 3600)  # "newer" than anything real
    source.backend.put(manifest_key("llm", forged), b'{"not": "signed"}')
    follower = PrefetchFollower(Access(standby), ["llm"], bandwidth=1e9, poll_interval_s=1.0)
    (result,) = follower.tick()
    assert result.checkpoint_id == real
    assert follower.tick() == []  # the forged one is not read again


def test_an_unreachable_store_changes_nothing_and_says_why(
    stores: tuple[CheckpointStore, CheckpointStore], tmp_path: Path
) -> None:
    _source, standby = stores
    access = Access(None)
    follower = PrefetchFollower(access, ["llm"], bandwidth=1e9, poll_interval_s=0.05)
    with pytest.raises(Unavailable):
        follower.tick()
    follower.start()
    try:
        deadline = time.monotonic() + 60
        while follower.state()["last_error"] is None:
            assert time.monotonic() < deadline, "the follower never said why"
            time.sleep(0.01)
        assert "unreachable" in str(follower.state()["last_error"])
        access.store = standby  # back: the next poll clears the error
        while follower.state()["last_error"] is not None:
            assert time.monotonic() < deadline, "the error stayed after the store came back"
            time.sleep(0.01)
    finally:
        follower.stop()
