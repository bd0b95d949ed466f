"""The local chunk index: which chunks a store holds, without asking the store per chunk.

It is a hint, never the truth (docs/design.md, "The local chunk index"): a push skips what it
lists, then proves before committing that every chunk it skipped is in the store
(``confirm.py``). It lives in SQLite under the cache directory and records the id of the
store it describes (``bind``): opened for a store with another id (the store was recreated
under the same URL) it forgets every entry. It is rebuilt from one LIST of the store's
``chunks/`` prefix (``rebuild_index``) when it is new or was emptied, when a gc may have
removed chunks since it was last synchronised (see ``locks.py``), or on request. Chunks
``verify`` found missing are dropped; chunks it found corrupt are marked *bad*, so the next
push uploads them again (replacing the object) even though a LIST still shows them.

Pending entries: a chunk put that returned is not yet durable on a backend that defers
durability (``file://``: no fsync per chunk; one ``sync`` before the manifest). Its entry is
committed as soon as the put returns, marked *pending* with the host's boot id, and cleared
by ``mark_synced`` once a sync has covered it. A pending entry is trusted only within the
same boot: if the process was killed the object is in the page cache and the next push's
sync makes it durable before any manifest names it (so the next push reuses it); if the
machine went down the object may be lost or torn, and opening the index after the reboot
forgets every pending entry of the previous boot, so it is uploaded again.
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from blake3 import blake3

from gpusnap.errors import FailedPrecondition
from gpusnap.storage.backend import Backend, sync_deferred
from gpusnap.storage.layout import CHUNK_PREFIX, chunk_id_of_key

log = logging.getLogger(__name__)


def current_boot_id() -> str:
    """This boot of this host; pending entries of another boot are not trusted."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        # Without a boot id, trust pending entries only within this process.
        return f"process-{os.getpid()}-{os.urandom(8).hex()}"


@contextmanager
def local_db_errors(what: str, os_what: str | None = None) -> Iterator[None]:
    """Opening a node-local SQLite file: its errors and the filesystem's are ``FailedPrecondition``.

    ``what`` begins the message of a SQLite error, ``os_what`` (default ``what``) that of an
    ``OSError``; each is followed by ``: `` and the cause.
    """
    try:
        yield
    except sqlite3.Error as exc:
        raise FailedPrecondition(f"{what}: {exc}") from exc
    except OSError as exc:
        raise FailedPrecondition(f"{os_what or what}: {exc.strerror or exc}") from exc


def default_cache_dir(store_url: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpusnap" / blake3(store_url.encode()).hexdigest()[:16]


class ChunkIndex:
    """A thread-safe set of chunk ids known to be in one store."""

    def __init__(self, path: Path, store_url: str, *, boot_id: str | None = None) -> None:
        # ``store_url`` is recorded for people reading the file; what the index is trusted
        # for is decided by the store id it is bound to (``bind``), not by where it is.
        self.path = path
        self.boot_id = boot_id or current_boot_id()
        # Pending marks are "<boot id>/<process token>-<serial>": unique per add.
        self._token = f"{os.getpid()}.{os.urandom(4).hex()}"
        self._serial = itertools.count()
        self._lock = threading.Lock()
        with local_db_errors(
            f"cannot open chunk index {path}",
            f"cannot create the chunk index directory {path.parent}",
        ):
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._db = sqlite3.connect(path, check_same_thread=False, timeout=30.0)
            with self._db:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS chunks (id TEXT PRIMARY KEY, size INTEGER)"
                )
                self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
                self._db.execute("CREATE TABLE IF NOT EXISTS bad (id TEXT PRIMARY KEY)")
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(chunks)")}
                if "pending" not in columns:  # an index made before pending entries existed
                    self._db.execute("ALTER TABLE chunks ADD COLUMN pending TEXT")
                forgotten = self._db.execute(
                    "DELETE FROM chunks WHERE substr(pending, 1, ?) != ?",
                    (len(self.boot_id) + 1, f"{self.boot_id}/"),
                ).rowcount
            if forgotten:
                log.info(
                    "chunk index %s: forgot %d chunks never synced before a reboot",
                    path,
                    forgotten,
                )
            self._set_meta("store_url", store_url)

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta(self, key: str, value: str) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (key, value))

    @property
    def store_id(self) -> str | None:
        """The id of the store this index describes (``None``: not bound yet)."""
        with self._lock:
            return self._meta("store_id")

    def bind(self, store_id: str) -> bool:
        """Make this the index of store ``store_id``; ``True`` if it described another one
        (or none) and so was emptied: its entries said nothing about this store.

        Pending entries stay (their puts returned on this boot and the next sync must still
        cover them); like every entry they are only a hint that the proof checks.
        """
        with self._lock, self._db:
            if self._meta("store_id") == store_id:
                return False
            had = self._db.execute("DELETE FROM chunks WHERE pending IS NULL").rowcount
            self._db.execute("DELETE FROM bad")
            self._db.execute("DELETE FROM meta WHERE k = 'synced_at'")
            self._db.execute(
                "INSERT OR REPLACE INTO meta (k, v) VALUES ('store_id', ?)", (store_id,)
            )
        if had:
            log.info("chunk index %s: forgot %d chunks of another store", self.path, had)
        return True

    @property
    def synced_at(self) -> float | None:
        """When the index was last rebuilt from a LIST (local clock), or ``None`` if never."""
        with self._lock:
            value = self._meta("synced_at")
        return None if value is None else float(value)

    def contains(self, chunk_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT 1 FROM chunks WHERE id = ?", (chunk_id,)).fetchone()
        return row is not None

    def add(self, chunk_id: str, size: int, *, pending: bool = False) -> None:
        """Record a chunk; ``pending`` when its put is not durable until the next sync."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO chunks (id, size, pending) VALUES (?, ?, ?)",
                (chunk_id, size, self._pending_mark() if pending else None),
            )
            self._db.execute("DELETE FROM bad WHERE id = ?", (chunk_id,))

    def _pending_mark(self) -> str:
        return f"{self.boot_id}/{self._token}-{next(self._serial)}"

    def pending(self) -> list[tuple[str, str]]:
        """The entries still waiting for a sync (this boot's only; see the module).

        Opaque tokens for ``mark_synced``: an entry added again after this call (a
        concurrent put of the same chunk, not covered by the caller's sync) gets a new
        token and stays pending.
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT id, pending FROM chunks WHERE pending IS NOT NULL"
            ).fetchall()
        return [(str(row[0]), str(row[1])) for row in rows]

    def mark_synced(self, entries: Iterable[tuple[str, str]]) -> None:
        """``entries`` (from ``pending``) were covered by a sync that has returned."""
        with self._lock, self._db:
            self._db.executemany(
                "UPDATE chunks SET pending = NULL WHERE id = ? AND pending = ?", entries
            )

    def discard(self, chunk_ids: Iterable[str]) -> None:
        """Forget chunks (gc deleted them, or the store turned out not to hold them)."""
        with self._lock, self._db:
            self._db.executemany("DELETE FROM chunks WHERE id = ?", ((i,) for i in chunk_ids))

    def mark_bad(self, chunk_ids: Iterable[str]) -> None:
        """Chunks whose object is in the store but damaged: never skipped again (a LIST
        still shows them) until a push has put them afresh, replacing the object."""
        ids = [(i,) for i in chunk_ids]
        with self._lock, self._db:
            self._db.executemany("DELETE FROM chunks WHERE id = ?", ids)
            self._db.executemany("INSERT OR IGNORE INTO bad (id) VALUES (?)", ids)

    def replace_all(self, entries: Iterable[tuple[str, int]], synced_at: float) -> int:
        """Make the durable entries exactly ``entries`` (one LIST), as of ``synced_at``.

        The caller syncs the backend between the LIST and this call, so that every listed
        object is durable. Pending entries the LIST did not show stay pending: a push of
        this boot put them after the LIST, and its sync must still cover them. Chunks marked
        bad are left out: the LIST shows a damaged object as well as a good one.
        """
        rows = list(entries)
        with self._lock, self._db:
            self._db.execute("DELETE FROM chunks WHERE pending IS NULL")
            bad = {str(r[0]) for r in self._db.execute("SELECT id FROM bad")}
            rows = [r for r in rows if r[0] not in bad]
            self._db.executemany(
                "INSERT OR REPLACE INTO chunks (id, size, pending) VALUES (?, ?, NULL)", rows
            )
            self._db.execute(
                "INSERT OR REPLACE INTO meta (k, v) VALUES ('synced_at', ?)", (repr(synced_at),)
            )
        log.debug("chunk index %s rebuilt: %d chunks", self.path, len(rows))
        return len(rows)

    def count(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def rebuild_index(backend: Backend, index: ChunkIndex) -> int:
    """Make ``index`` what one LIST of the store's chunks shows; returns the chunk count."""
    listed_at = time.time()
    entries = []
    for info in backend.list(CHUNK_PREFIX):
        chunk_id = chunk_id_of_key(info.key)
        if chunk_id is not None:
            entries.append((chunk_id, info.size))
    # A listed chunk may be one a local push put but has not synced yet (perhaps with
    # another index): sync everything, so that every entry of the rebuilt index is
    # durable. Rebuilds are rare (first use, after a gc), so a whole-store sync is fine.
    sync_deferred(backend)
    return index.replace_all(entries, listed_at)
