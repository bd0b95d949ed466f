"""The chunk cache's index in SQLite: its schema, opening it, and its small accessors.

``entries`` holds one row per object (``writer`` set while it is written), ``totals`` the
running counts (``used`` is the bytes held, kept in the same transactions as the rows),
``scopes`` what ``stats`` shows for each store, ``meta`` the budget and the boot of the last
open. WAL mode with ``synchronous = NORMAL``: a power cut may lose the last transactions,
never corrupt the file (``repair.py`` reconciles the files after a reboot).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

log = logging.getLogger(__name__)

DB_NAME = "chunks.sqlite"
COUNTERS = ("used", "hits", "misses", "bytes_hit", "bytes_added", "evicted", "dropped")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    scope TEXT NOT NULL, id TEXT NOT NULL, size INTEGER NOT NULL,
    last_used INTEGER NOT NULL, writer TEXT, PRIMARY KEY (scope, id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
CREATE TABLE IF NOT EXISTS scopes (scope TEXT PRIMARY KEY, label TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS totals (name TEXT PRIMARY KEY, n INTEGER NOT NULL);
"""


def connect(path: Path) -> tuple[sqlite3.Connection, bool]:
    """The index, and whether it was made anew (its objects are then adopted from the files).

    An index SQLite cannot read is moved aside and made again: the files are the truth.
    """
    fresh = not path.exists()
    for attempt in range(2):
        db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            return db, fresh
        except sqlite3.DatabaseError as exc:
            db.close()
            # Only a file that is no database, or a damaged one: never one merely busy.
            if attempt or exc.sqlite_errorname not in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
                raise
            aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
            log.warning(
                "chunk cache: index %s unreadable (%s); rebuilt, old one at %s", path, exc, aside
            )
            os.replace(path, aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            fresh = True
    raise AssertionError("unreachable")


def meta(db: sqlite3.Connection, key: str) -> str | None:
    row = db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def set_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (key, value))


def total(db: sqlite3.Connection, name: str) -> int:
    row = db.execute("SELECT n FROM totals WHERE name = ?", (name,)).fetchone()
    return 0 if row is None else int(row[0])


def add(db: sqlite3.Connection, name: str, n: int) -> None:
    db.execute("UPDATE totals SET n = n + ? WHERE name = ?", (n, name))
