"""``ChunkCache``: the node's content-addressed chunk cache, a directory within a byte budget.

Every pull on the node shares one (the daemon's restores, ``gpusnap store pull``, a standby's
prefetch), each process with its own ``ChunkCache`` on the same directory. The cache holds
chunk objects exactly as a store holds them (compressed, encrypted, named by chunk id), so a
cached chunk is decoded and verified like one fetched from the store, and a store's chunks
live in that store's *scope* only (``scope_of``): chunks of two stores never mix.

The index is SQLite in WAL mode (``db.py``): one row per object, ``(scope, id, size,
last_used, writer)``, and running totals. The budget is kept by reservation: a writer
reserves an object's bytes in a write transaction (evicting the least recently used objects,
files and rows together, until they fit) before it creates any file, so the bytes of every
file under the directory never exceed the budget, whatever number of processes fill it.
``writer`` is set while the object is written (temp file, then rename) and cleared after;
the rows and temp files of writers that died are removed when a cache is opened
(``repair.py``), and after a reboot (or with a lost index) the index is rebuilt from the files.

Nothing here raises into a pull: a cache that cannot read or write logs and behaves as a
miss. Hits, misses and last-use times are batched in memory and written every
``_TOUCH_BATCH`` uses or ``_TOUCH_SECONDS``.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from gpusnap.errors import FailedPrecondition, NotFound
from gpusnap.storage.cache.db import COUNTERS, DB_NAME, add, connect, meta, set_meta, total
from gpusnap.storage.cache.files import CacheFiles, Oversized, check_chunk_id
from gpusnap.storage.cache.repair import reap_dead_writers, repair
from gpusnap.storage.cache.writers import WriterToken
from gpusnap.storage.index import local_db_errors

log = logging.getLogger(__name__)

# The daemon's default ``[cache] dir`` (``<state_dir>/cache``), which ``gpusnap cache`` and
# ``gpusnap store pull`` use when given no other.
DEFAULT_CACHE_DIR = Path("/var/lib/gpusnap/cache")
# A new cache without a budget given gets this fraction of its file system.
DEFAULT_FS_FRACTION = 0.25
_TOUCH_BATCH = 256
_TOUCH_SECONDS = 1.0
_EVICT_BATCH = 64
_PRESENT = "SELECT id, size FROM entries WHERE scope = ? AND writer IS NULL AND id IN"


def scope_of(store_key: str, fingerprint: str = "") -> str:
    """The scope of a store's chunks: a hash of what identifies the store (its URL, for now;
    ``context.cache_key``) and of its chunk-naming key (``fingerprint``), so that neither two
    stores nor one store read with two encryption keys ever share an object."""
    text = f"gpusnap chunk cache scope 1\0{store_key}\0{fingerprint}"
    return str(blake3(text.encode()).hexdigest())[:32]


@dataclass(frozen=True)
class ScopeStats:
    scope: str
    store: str
    entries: int
    bytes: int


@dataclass
class CacheStats:
    """What ``gpusnap cache stats`` shows; counters are the cache's, over every process."""

    dir: str
    entries: int
    bytes: int
    max_bytes: int
    writing: int
    hits: int
    misses: int
    bytes_hit: int
    bytes_added: int
    evicted: int
    dropped: int
    stores: list[ScopeStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PruneResult:
    entries_evicted: int
    bytes_freed: int
    bytes_left: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ChunkCache:
    """A chunk cache directory within ``max_bytes``; thread-safe, and shared across processes.

    ``max_bytes`` given is recorded as the cache's budget (and the cache pruned to it);
    without it the recorded one holds (a new cache: ``DEFAULT_FS_FRACTION`` of its file
    system). Without ``create`` a missing cache is ``NotFound``. Opening repairs (``repair``).
    """

    def __init__(self, directory: Path, *, max_bytes: int | None = None, create: bool = True):
        self.dir = directory
        self.files = CacheFiles(directory)
        self._token = WriterToken.mine()
        self._temp_prefix = self._token.temp_prefix()
        self._serial = 0
        self._lock = threading.RLock()  # _tx holds it; helpers inside take it again
        self._touches: dict[tuple[str, str], int] = {}
        self._counts: Counter[str] = Counter()
        self._flushed_at = time.monotonic()
        db_path = directory / DB_NAME
        with local_db_errors(f"cannot open the chunk cache in {directory}"):
            if not create and not db_path.exists():
                raise NotFound(f"no chunk cache in {directory}")
            _check_dir(directory, create=create)
            self.files.make_dirs()
            self._db, rebuilt = connect(db_path)
            with self._tx() as db:
                for name in COUNTERS:
                    db.execute("INSERT OR IGNORE INTO totals (name, n) VALUES (?, 0)", (name,))
                if max_bytes is not None:
                    set_meta(db, "max_bytes", str(max_bytes))
                elif meta(db, "max_bytes") is None:
                    set_meta(db, "max_bytes", str(_default_budget(directory)))
                self.max_bytes = int(meta(db, "max_bytes") or 0)
                full = rebuilt or meta(db, "boot_id") != self._token.boot_id
                repair(db, self.files, full=full)
                set_meta(db, "boot_id", self._token.boot_id)
                self._evict_to(db, self.max_bytes)

    # --- what the scoped view (``StoreCache``) uses --------------------------------------

    def register(self, scope: str, label: str) -> None:
        """Name a scope for ``stats`` (cosmetic: a failure is only logged)."""
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT OR REPLACE INTO scopes (scope, label) VALUES (?, ?)", (scope, label)
                )
        except sqlite3.Error as exc:
            log.warning("chunk cache: cannot record store %s: %s", label, exc)

    def get(self, scope: str, chunk_id: str) -> bytes | None:
        """The cached object, or ``None``. Not verified here: the caller decodes it."""
        check_chunk_id(chunk_id)
        try:
            data = self.files.read(scope, chunk_id)
        except Oversized as exc:
            self.discard(scope, chunk_id, f"larger than any chunk object ({exc})")
            data = None
        except OSError as exc:
            log.warning("chunk cache: cannot read %s: %s", chunk_id, exc.strerror or exc)
            data = None
        with self._lock:
            if data is None:
                self._counts["misses"] += 1
            else:
                self._counts["hits"] += 1
                self._counts["bytes_hit"] += len(data)
                self._touches[(scope, chunk_id)] = time.time_ns()
            due = (
                len(self._touches) >= _TOUCH_BATCH
                or time.monotonic() - self._flushed_at >= _TOUCH_SECONDS
            )
        if due:
            self.flush()
        return data

    def put(self, scope: str, chunk_id: str, data: bytes) -> bool:
        """Keep ``data`` (a verified chunk object); ``False`` if it was not added (already
        there, larger than the budget, no room beside objects being written, a disk error)."""
        check_chunk_id(chunk_id)
        need = len(data)
        if need > self.max_bytes or self.files.exists(scope, chunk_id):
            return False
        try:
            with self._tx() as db:
                row = db.execute(
                    "SELECT writer FROM entries WHERE scope = ? AND id = ?", (scope, chunk_id)
                ).fetchone()
                if row is not None:
                    if row[0] is not None:
                        return False  # another writer is on it
                    self._drop_row(db, scope, chunk_id)  # its file is gone
                if not self._make_room(db, need):
                    return False
                db.execute(
                    "INSERT INTO entries (scope, id, size, last_used, writer) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (scope, chunk_id, need, time.time_ns(), str(self._token)),
                )
                add(db, "used", need)
                self._serial += 1
                temp_name = f"{self._temp_prefix}{self._serial}"
        except (sqlite3.Error, OSError) as exc:  # OSError: evicting an object failed
            log.warning("chunk cache: cannot reserve %d bytes: %s", need, exc)
            return False
        try:
            self.files.write(scope, chunk_id, data, temp_name)
        except OSError as exc:
            log.warning("chunk cache: cannot write %s: %s", chunk_id, exc.strerror or exc)
            self._give_back(scope, chunk_id)
            return False
        try:
            with self._tx() as db:
                db.execute(
                    "UPDATE entries SET writer = NULL, last_used = ? "
                    "WHERE scope = ? AND id = ? AND writer = ?",
                    (time.time_ns(), scope, chunk_id, str(self._token)),
                )
                add(db, "bytes_added", need)
        except sqlite3.Error as exc:
            # The object is whole; a later open sees a dead writer's row and removes both.
            log.warning("chunk cache: cannot mark %s written: %s", chunk_id, exc)
        return True

    def discard(self, scope: str, chunk_id: str, reason: str) -> None:
        """Remove an object that failed its checks (it is never read again)."""
        log.warning("chunk cache: dropping chunk %s: %s", chunk_id, reason)
        try:
            with self._tx() as db:
                self.files.unlink(scope, chunk_id)
                self._drop_row(db, scope, chunk_id)
                add(db, "dropped", 1)
        except (sqlite3.Error, OSError) as exc:
            log.warning("chunk cache: cannot drop %s: %s", chunk_id, exc)

    def present(self, scope: str, chunk_ids: Iterable[str]) -> dict[str, int]:
        """Which of ``chunk_ids`` the index holds (written, not being written): id -> bytes."""
        ids = list(dict.fromkeys(chunk_ids))
        found: dict[str, int] = {}
        try:
            with self._lock:
                for start in range(0, len(ids), 500):
                    batch = ids[start : start + 500]
                    marks = ",".join("?" * len(batch))  # placeholders only: no value in SQL
                    query = f"{_PRESENT} ({marks})"
                    rows = self._db.execute(query, (scope, *batch)).fetchall()
                    found.update((str(r[0]), int(r[1])) for r in rows)
        except sqlite3.Error as exc:
            log.warning("chunk cache: cannot look up chunks: %s", exc)
        return found

    def touch(self, scope: str, chunk_ids: Iterable[str]) -> None:
        """Make ``chunk_ids`` the most recently used (a standby keeps its checkpoint)."""
        now = time.time_ns()
        with self._lock:
            for chunk_id in chunk_ids:
                self._touches[(scope, chunk_id)] = now
        self.flush()

    # --- the whole cache ------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """The cache's figures (``FailedPrecondition`` if its index cannot be read)."""
        try:
            return self._stats()
        except sqlite3.Error as exc:
            raise FailedPrecondition(f"chunk cache {self.dir}: {exc}") from exc

    def _stats(self) -> CacheStats:
        self.flush()
        with self._lock:
            db = self._db
            totals = {str(r[0]): int(r[1]) for r in db.execute("SELECT name, n FROM totals")}
            entries, writing = db.execute("SELECT COUNT(*), COUNT(writer) FROM entries").fetchone()
            stores = [
                ScopeStats(str(r[0]), str(r[1] or ""), int(r[2]), int(r[3]))
                for r in db.execute(
                    "SELECT e.scope, s.label, COUNT(*), SUM(e.size) FROM entries e "
                    "LEFT JOIN scopes s ON s.scope = e.scope GROUP BY e.scope ORDER BY e.scope"
                )
            ]
        return CacheStats(
            dir=str(self.dir),
            entries=int(entries) - int(writing),
            bytes=totals["used"],
            max_bytes=self.max_bytes,
            writing=int(writing),
            hits=totals["hits"],
            misses=totals["misses"],
            bytes_hit=totals["bytes_hit"],
            bytes_added=totals["bytes_added"],
            evicted=totals["evicted"],
            dropped=totals["dropped"],
            stores=stores,
        )

    def prune(self, to_bytes: int) -> PruneResult:
        """Evict the least recently used objects until at most ``to_bytes`` are held."""
        self.flush()
        try:
            with self._tx() as db:
                count, freed = self._evict_to(db, max(0, to_bytes))
                left = total(db, "used")
        except sqlite3.Error as exc:
            raise FailedPrecondition(f"chunk cache {self.dir}: {exc}") from exc
        return PruneResult(count, freed, left)

    def flush(self) -> None:
        """Write the batched last-use times and counters."""
        with self._lock:
            touches, self._touches = self._touches, {}
            counts, self._counts = self._counts, Counter()
            self._flushed_at = time.monotonic()
        if not touches and not counts:
            return
        try:
            with self._tx() as db:
                self._write_touches(db, touches, counts)
        except sqlite3.Error as exc:
            log.warning("chunk cache: cannot record use: %s", exc)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._db.close()

    def __enter__(self) -> ChunkCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inside a write transaction -------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (``BEGIN IMMEDIATE``: one writer at a time, across processes)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _write_touches(
        self, db: sqlite3.Connection, touches: dict[tuple[str, str], int], counts: Counter[str]
    ) -> None:
        db.executemany(
            "UPDATE entries SET last_used = max(last_used, ?) "
            "WHERE scope = ? AND id = ? AND writer IS NULL",
            ((at, scope, cid) for (scope, cid), at in touches.items()),
        )
        for name, n in counts.items():
            add(db, name, n)

    def _make_room(self, db: sqlite3.Connection, need: int) -> bool:
        # What this process used last must count before victims are chosen.
        touches, self._touches = self._touches, {}
        self._write_touches(db, touches, Counter())
        # The budget is the cache's, not this process's: another may have set a new one.
        self.max_bytes = int(meta(db, "max_bytes") or self.max_bytes)
        target = self.max_bytes - need
        self._evict_to(db, target)
        if total(db, "used") > target:
            # Perhaps held by writers that died since this cache was opened.
            reap_dead_writers(db, self.files)
            self._evict_to(db, target)
        return total(db, "used") <= target

    def _evict_to(self, db: sqlite3.Connection, target: int) -> tuple[int, int]:
        """Evict least recently used objects (file first, then row) while over ``target``."""
        used = total(db, "used")
        count = freed = 0
        while used > target:
            victims = db.execute(
                "SELECT scope, id, size FROM entries WHERE writer IS NULL "
                "ORDER BY last_used, id LIMIT ?",
                (_EVICT_BATCH,),
            ).fetchall()
            if not victims:
                break
            for scope, chunk_id, size in victims:
                self.files.unlink(scope, chunk_id)
                db.execute("DELETE FROM entries WHERE scope = ? AND id = ?", (scope, chunk_id))
                used -= size
                freed += size
                count += 1
                if used <= target:
                    break
        if count:
            add(db, "used", -freed)
            add(db, "evicted", count)
            log.debug("chunk cache: evicted %d objects (%d bytes)", count, freed)
        return count, freed

    def _drop_row(self, db: sqlite3.Connection, scope: str, chunk_id: str) -> None:
        row = db.execute(
            "DELETE FROM entries WHERE scope = ? AND id = ? RETURNING size", (scope, chunk_id)
        ).fetchone()
        if row is not None:
            add(db, "used", -int(row[0]))

    def _give_back(self, scope: str, chunk_id: str) -> None:
        try:
            with self._tx() as db:
                self.files.unlink(scope, chunk_id)
                row = db.execute(
                    "DELETE FROM entries WHERE scope = ? AND id = ? AND writer = ? RETURNING size",
                    (scope, chunk_id, str(self._token)),
                ).fetchone()
                if row is not None:
                    add(db, "used", -int(row[0]))
        except (sqlite3.Error, OSError) as exc:
            log.warning("chunk cache: cannot give back %s: %s", chunk_id, exc)


def _check_dir(directory: Path, *, create: bool) -> None:
    """The directory exists (made 0700 with ``create``), is ours and only we may write to it:
    the daemon runs as root, and writes through what it finds there."""
    if create:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = directory.stat()
    except FileNotFoundError:
        raise NotFound(f"no chunk cache in {directory}") from None
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise FailedPrecondition(
            f"chunk cache directory {directory} must belong to this user and be writable by "
            "no one else"
        )


def _default_budget(directory: Path) -> int:
    fs = os.statvfs(directory)
    return int(fs.f_blocks * fs.f_frsize * DEFAULT_FS_FRACTION)
