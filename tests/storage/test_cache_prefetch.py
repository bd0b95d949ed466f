"""Prefetch into the node's chunk cache: what it fetches, its budget, its bandwidth cap.

The token bucket is tested on an injected clock (no real time); the cap of a real prefetch is
checked as an upper bound on bytes over time, which a slow machine can only make easier.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gpusnap.errors import FailedPrecondition
from gpusnap.storage import ChunkCache
from gpusnap.storage.layout import chunk_key
from gpusnap.storage.prefetch import TokenBucket
from tests.storage.store_helpers import Keys, MiB, random_bytes
from tests.storage.test_cache_pull import flip_byte, opened


def write_image(root: Path, mib: int, seed: int) -> Path:
    root.mkdir()
    (root / "pages.img").write_bytes(random_bytes(mib * MiB, seed))
    (root / "zeros.img").write_bytes(bytes(17 * MiB))  # two all-zero maximum chunks
    return root


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_token_bucket_never_lets_more_than_burst_plus_rate_times_time() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst=4000.0, clock=clock, sleep=clock.sleep)
    taken = 0
    for n in [1500, 700, 4000, 10, 2500] * 40:
        assert bucket.take(n)
        taken += n
        assert taken <= 4000 + 1000 * clock.now + 1e-6
    # ...and it does not starve: the long-run rate is the cap.
    assert taken >= 1000 * clock.now
    bucket.settle(3000)  # 3000 more went than were taken: the next take waits for them
    before = clock.now
    assert bucket.take(1000)
    assert clock.now - before >= 3.0


def test_a_take_gives_up_when_stopped() -> None:
    bucket = TokenBucket(10.0, burst=10.0)
    assert bucket.take(10)
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    assert not bucket.take(10_000, stop)  # would take ~1000 s


def test_prefetch_fetches_only_what_the_cache_lacks(tmp_path: Path, keys: Keys) -> None:
    src = write_image(tmp_path / "src", 12, 1)
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache) as store:
            pushed = store.push(src, workload="w")
            assert store.warm_bytes(pushed.checkpoint_id) == (0, 12 * MiB + MiB)
            first = store.prefetch(pushed.checkpoint_id)
            assert first.warm_fraction == 1.0 and first.bytes_warm == first.bytes_total
            assert first.chunks_fetched > 0 and first.chunks_left == 0
            again = store.prefetch(pushed.checkpoint_id)
            assert again.chunks_fetched == 0 and again.bytes_fetched == 0
            pulled = store.pull(pushed.checkpoint_id, tmp_path / "dest")
        assert pulled.bytes_fetched == 0
        assert (tmp_path / "dest" / "pages.img").read_bytes() == (src / "pages.img").read_bytes()


def test_prefetch_takes_no_more_than_the_budget_holds(tmp_path: Path, keys: Keys) -> None:
    src = write_image(tmp_path / "src", 24, 2)
    budget = 10 * MiB
    with ChunkCache(tmp_path / "cache", max_bytes=budget) as cache:
        with opened(tmp_path, keys, cache) as store:
            pushed = store.push(src, workload="w")
            result = store.prefetch(pushed.checkpoint_id, threads=2)
        assert 0 < result.warm_fraction < 1
        assert result.chunks_left > 0
        assert cache.stats().bytes <= budget
        assert cache.stats().evicted == 0  # it stopped before evicting its own chunks


def test_a_stopped_prefetch_says_so_and_fetches_nothing_more(tmp_path: Path, keys: Keys) -> None:
    src = write_image(tmp_path / "src", 6, 3)
    stop = threading.Event()
    stop.set()
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache) as store:
            pushed = store.push(src, workload="w")
            result = store.prefetch(pushed.checkpoint_id, stop=stop)
    assert result.stopped and result.chunks_fetched == 0


def test_prefetch_lists_a_corrupt_store_chunk_and_does_not_cache_it(
    tmp_path: Path, keys: Keys
) -> None:
    src = write_image(tmp_path / "src", 6, 4)
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache) as store:
            pushed = store.push(src, workload="w")
            bad = store.manifest(pushed.checkpoint_id).files[0].chunks[1].id
            flip_byte(tmp_path / "store" / chunk_key(bad), at=4096)
            result = store.prefetch(pushed.checkpoint_id)
            assert len(result.problems) == 1 and bad in result.problems[0]
            assert result.chunks_left == 1
            assert store.cache is not None and store.cache.present([bad]) == {}


def test_prefetch_needs_a_cache(tmp_path: Path, keys: Keys) -> None:
    src = write_image(tmp_path / "src", 1, 5)
    with opened(tmp_path, keys, None) as store:
        pushed = store.push(src, workload="w")
        with pytest.raises(FailedPrecondition, match="chunk cache"):
            store.prefetch(pushed.checkpoint_id)
        assert store.warm_fraction(pushed.checkpoint_id) == 0.0


def test_a_capped_prefetch_stays_under_its_bandwidth(tmp_path: Path, keys: Keys) -> None:
    src = write_image(tmp_path / "src", 24, 6)
    rate = 8 * MiB
    bucket = TokenBucket(rate, burst=8 * MiB)
    samples: list[tuple[float, int]] = []
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache) as store:
            pushed = store.push(src, workload="w")
            started = time.monotonic()
            result = store.prefetch(
                pushed.checkpoint_id,
                bucket=bucket,
                threads=2,
                progress=lambda done, _total: samples.append((time.monotonic(), done)),
            )
    assert result.warm_fraction == 1.0
    assert samples and samples[-1][1] == 25 * MiB  # and the 1 MiB zero chunk (not a maximum one)
    # Each chunk is paid for before it is fetched, so by any moment at most the burst plus
    # the rate times the time since the start can have arrived (an object's header and the
    # GCM tag are the small margin).
    for at, done in samples:
        assert done <= 8 * MiB + rate * (at - started) + 64 * 1024
    assert result.seconds >= (25 * MiB - 8 * MiB) / rate * 0.99
