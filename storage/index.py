"""The local chunk index: which chunks a store holds, without asking the store per chunk.

It is a cache, never the truth. It lives in SQLite under the cache directory, keyed by the
store URL, and is rebuilt from one LIST of the store's ``chunks/`` prefix when it is missing,
when a gc may have removed chunks since it was last synchronised (see ``store.py``), or on
request. Entries are committed as soon as a chunk's put returns, so a push killed half-way
leaves an index that still knows every chunk it wrote.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path

from blake3 import blake3

from gpusnap.storage.errors import FailedPrecondition

log = logging.getLogger(__name__)


def default_cache_dir(store_url: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpusnap" / blake3(store_url.encode()).hexdigest()[:16]


class ChunkIndex:
    """A thread-safe set of chunk ids known to be in one store."""

    def __init__(self, path: Path, store_url: str) -> None:
        self.path = path
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
            stored_url = self._meta("store_url")
            if stored_url is None:
                self._set_meta("store_url", store_url)
            elif stored_url != store_url:
                raise FailedPrecondition(
                    f"chunk index {path} belongs to store {stored_url}, not {store_url}"
                )
        except sqlite3.Error as exc:
            raise FailedPrecondition(f"cannot open chunk index {path}: {exc}") from exc

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

    def add(self, chunk_id: str, size: int) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO chunks (id, size) VALUES (?, ?)", (chunk_id, size)
            )

    def discard(self, chunk_ids: Iterable[str]) -> None:
        with self._lock, self._db:
            self._db.executemany("DELETE FROM chunks WHERE id = ?", ((i,) for i in chunk_ids))

    def replace_all(self, entries: Iterable[tuple[str, int]], synced_at: float) -> int:
        """Make the index exactly ``entries`` (one LIST of the store), as of ``synced_at``."""
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
