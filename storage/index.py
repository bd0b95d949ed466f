"""The local chunk index: which chunks a store holds, without asking the store per chunk.

It is a cache, never the truth. It lives in SQLite under the cache directory, keyed by the
store URL, and is rebuilt from one LIST of the store's ``chunks/`` prefix (``rebuild_index``)
when it is missing, when a gc may have removed chunks since it was last synchronised (see
``locks.py``), or on request.

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
from collections.abc import Iterable
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


def default_cache_dir(store_url: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpusnap" / blake3(store_url.encode()).hexdigest()[:16]


class ChunkIndex:
    """A thread-safe set of chunk ids known to be in one store."""

    def __init__(self, path: Path, store_url: str, *, boot_id: str | None = None) -> None:
        self.path = path
        self.boot_id = boot_id or current_boot_id()
        # Pending marks are "<boot id>/<process token>-<serial>": unique per add.
        self._token = f"{os.getpid()}.{os.urandom(4).hex()}"
        self._serial = itertools.count()
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._db = sqlite3.connect(path, check_same_thread=False, timeout=30.0)
            with self._db:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS chunks (id TEXT PRIMARY KEY, size INTEGER)"
                )
                self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
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
            stored_url = self._meta("store_url")
            if stored_url is None:
                self._set_meta("store_url", store_url)
            elif stored_url != store_url:
                raise FailedPrecondition(
                    f"chunk index {path} belongs to store {stored_url}, not {store_url}"
                )
        except sqlite3.Error as exc:
            raise FailedPrecondition(f"cannot open chunk index {path}: {exc}") from exc
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot create the chunk index directory {path.parent}: {exc.strerror or exc}"
            ) from exc

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta(self, key: str, value: str) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (key, value))

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
        with self._lock, self._db:
            self._db.executemany("DELETE FROM chunks WHERE id = ?", ((i,) for i in chunk_ids))

    def replace_all(self, entries: Iterable[tuple[str, int]], synced_at: float) -> int:
        """Make the index exactly ``entries`` (one LIST of the store), as of ``synced_at``.

        The caller syncs the backend between the LIST and this call, so that every listed
        object is durable and none is pending.
        """
        rows = list(entries)
        with self._lock, self._db:
            self._db.execute("DELETE FROM chunks")
            self._db.executemany("INSERT OR REPLACE INTO chunks (id, size) VALUES (?, ?)", rows)
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
