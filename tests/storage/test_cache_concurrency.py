"""The chunk cache across processes: a shared budget, and writers killed mid-write.

Real processes on one cache directory. Bytes on disk are counted while holding the index's
write lock (no process can then reserve, evict or rename past a reservation), walking
``objects/`` before ``tmp/`` (a file only ever moves from ``tmp/`` to ``objects/``, so no
file is counted twice): an exact count, not a sample that could straddle an eviction.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpusnap.storage.cache import ChunkCache, scope_of
from gpusnap.storage.cache.db import DB_NAME
from tests.cli._cli import make_cli
from tests.storage.store_helpers import MiB, random_bytes
from tests.storage.test_cache import cid, disk_bytes

SCOPE = scope_of("file:///shared")

_FILLER = """
import os, sqlite3, sys
from pathlib import Path
from blake3 import blake3
from gpusnap.storage.cache import ChunkCache, scope_of
from gpusnap.storage.cache.db import DB_NAME
directory, budget, tag, count = sys.argv[1:5]

def locked_disk_bytes():  # as the module's locked_disk_bytes, here after each of its puts
    db = sqlite3.connect(Path(directory) / DB_NAME, timeout=60, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            return sum(p.stat().st_size for sub in ("objects", "tmp")
                       for p in (Path(directory) / sub).rglob("*") if p.is_file())
        finally:
            db.execute("ROLLBACK")
    finally:
        db.close()

seen = []
with ChunkCache(Path(directory), max_bytes=int(budget)) as cache:
    for i in range(int(count)):
        chunk_id = blake3(f"{tag}-{i}".encode()).hexdigest()
        cache.put(scope_of("file:///shared"), chunk_id, os.urandom(20_000 + (i * 7919) % 30_000))
        if i % 3 == 0:
            cache.get(scope_of("file:///shared"), chunk_id)
        if i % 10 == 0:
            seen.append(locked_disk_bytes())
print(len(seen), max(seen))
"""
# A writer that stops for good at one point of a put: after the first piece of its temp
# file ("write"), or after renaming it into place ("rename"); it says "ready" there.
_STOPPER = """
import os, sys, time
from pathlib import Path
from gpusnap.storage.cache import ChunkCache, scope_of
directory, chunk_id, where = sys.argv[1:4]
cache = ChunkCache(Path(directory), max_bytes=64 << 20)
real = getattr(os, where)
def stop_after(*args, **kwargs):
    result = real(*args, **kwargs)
    sys.stdout.write("ready\\n")
    sys.stdout.flush()
    time.sleep(3600)
    return result
setattr(os, where, stop_after)
cache.put(scope_of("file:///shared"), chunk_id, os.urandom(3 << 20))
"""


def locked_disk_bytes(directory: Path) -> int:
    db = sqlite3.connect(directory / DB_NAME, timeout=60, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            return disk_bytes(directory)
        finally:
            db.execute("ROLLBACK")
    finally:
        db.close()


def test_two_processes_filling_one_cache_never_exceed_its_budget(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    budget = 400_000  # made by whichever filler opens it first
    fillers = [
        subprocess.Popen(
            [sys.executable, "-c", _FILLER, str(directory), str(budget), tag, "300"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("one", "two")
    ]
    seen: list[int] = []
    try:
        while any(p.poll() is None for p in fillers):
            if (directory / DB_NAME).exists():
                seen.append(locked_disk_bytes(directory))
            time.sleep(0.005)  # let the writers have the lock too
    finally:
        reports = [proc.communicate(timeout=300)[0] for proc in fillers]
    assert [proc.returncode for proc in fillers] == [0, 0]
    # Each filler counted the directory after every tenth of its puts (30 counts each, whatever
    # the speed of the machine); this process counted as often as it could alongside.
    for report in reports:
        counts, most = map(int, report.split())
        assert counts == 30 and 0 < most <= budget
    assert max(seen, default=0) <= budget
    with ChunkCache(directory) as cache:
        stats = cache.stats()
    assert stats.bytes == disk_bytes(directory) <= budget
    assert stats.writing == 0
    assert stats.evicted > 0 and stats.bytes_added > budget  # they really competed


def test_a_writer_killed_mid_write_leaves_nothing_that_is_used(tmp_path: Path) -> None:
    for where in ("write", "rename"):
        directory = tmp_path / where
        chunk_id = cid(where)
        with subprocess.Popen(
            [sys.executable, "-c", _STOPPER, str(directory), chunk_id, where],
            stdout=subprocess.PIPE,
            text=True,
        ) as writer:
            try:
                _kill_when_ready(writer)
                temps = list((directory / "tmp").iterdir())
                if where == "write":
                    assert len(temps) == 1 and 0 < temps[0].stat().st_size < 3 * MiB
                else:
                    assert temps == []
                with ChunkCache(directory) as cache:
                    assert cache.get(SCOPE, chunk_id) is None
                    assert cache.stats().bytes == 0 and cache.stats().writing == 0
                assert disk_bytes(directory) == 0
            finally:
                writer.kill()
                writer.wait(timeout=60)


def _kill_when_ready(writer: subprocess.Popen[str]) -> None:
    """SIGKILL the writer once it says "ready", and leave it a zombie (not reaped), as under
    a PID 1 that reaps late: it is dead all the same."""
    assert writer.stdout is not None
    assert writer.stdout.readline() == "ready\n"
    writer.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{writer.pid}/stat").read_text().rpartition(") ")[2][0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_pull_killed_at_any_moment_leaves_a_cache_the_next_pull_trusts(
    tmp_path: Path,
) -> None:
    cli = make_cli(tmp_path)
    image = tmp_path / "image"
    image.mkdir()
    for n in range(4):
        (image / f"pages-{n}.img").write_bytes(random_bytes(16 * MiB, n))
    checkpoint = cli.push(image, "w")["checkpoint_id"]
    cache_dir = tmp_path / "node-cache"
    env = cli.environ()
    for round_ in range(3):
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "gpusnap.cli.main", "store", "pull", checkpoint),
                *(str(tmp_path / f"killed-{round_}"), "--cache-dir", str(cache_dir)),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wanted = 3 * (round_ + 1)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            objects = cache_dir / "objects"
            if objects.exists() and sum(1 for p in objects.rglob("*") if p.is_file()) >= wanted:
                break
            time.sleep(0.005)
        proc.kill()
        proc.wait(timeout=60)
    with ChunkCache(cache_dir) as cache:
        stats = cache.stats()
        assert stats.writing == 0
        assert list((cache_dir / "tmp").iterdir()) == []
        assert stats.bytes == disk_bytes(cache_dir)
    pulled = cli.ok(
        "store",
        "pull",
        checkpoint,
        str(tmp_path / "after"),
        "--cache-dir",
        str(cache_dir),
        "--json",
    ).json()
    assert pulled["bytes_cached"] > 0
    for n in range(4):
        assert (tmp_path / "after" / f"pages-{n}.img").read_bytes() == (
            image / f"pages-{n}.img"
        ).read_bytes()
    with ChunkCache(cache_dir) as cache:
        assert cache.stats().dropped == 0  # nothing a killed writer left failed its checks


def test_two_pulls_at_once_share_one_small_cache(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    ids = []
    for n in range(2):
        image = tmp_path / f"image-{n}"
        image.mkdir()
        (image / "pages.img").write_bytes(random_bytes(24 * MiB, 40 + n))
        ids.append(cli.push(image, f"w{n}")["checkpoint_id"])
    cache_dir = tmp_path / "node-cache"
    budget = 20 * MiB
    ChunkCache(cache_dir, max_bytes=budget).close()
    results: dict[int, object] = {}

    def pull(n: int) -> None:
        results[n] = cli.ok(
            "store", "pull", ids[n], str(tmp_path / f"dest-{n}"), "--cache-dir", str(cache_dir)
        )

    threads = [threading.Thread(target=pull, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        seen.append(locked_disk_bytes(cache_dir))
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert len(results) == 2
    assert max(seen) <= budget
    for n in range(2):
        assert (tmp_path / f"dest-{n}" / "pages.img").read_bytes() == (
            tmp_path / f"image-{n}" / "pages.img"
        ).read_bytes()
    with ChunkCache(cache_dir) as cache:
        assert cache.stats().bytes == disk_bytes(cache_dir) <= budget
