"""Putting a chunk cache right when it is opened: what dead writers left, and a lost index.

Run inside the opening write transaction (so no other process reserves or evicts meanwhile):

- every row still marked with a writer that no longer lives (``writers.py``) is removed with
  its object, if the writer got as far as renaming it: an object whose writer died before
  saying it was written is never used, even if whole;
- every temp file of a dead writer is removed;
- after a reboot, or when the index was made anew (it was missing or unreadable), the index
  is made to agree with the files: an object file with no row is adopted (its size, its
  mtime as its last use; reading verifies it anyway), a row with no file is removed. A
  reboot is the case that needs it: the objects were not fsynced and SQLite's ``synchronous
  = NORMAL`` may lose the last transactions in a power cut, so rows and files can disagree;
- the running total of bytes is recomputed from the rows.

Objects being written by live processes (their rows and temp files) are left alone.
"""

from __future__ import annotations

import logging
import sqlite3

from gpusnap.storage.cache.files import CacheFiles
from gpusnap.storage.cache.writers import WriterToken, temp_writer_alive

log = logging.getLogger(__name__)


def reap_dead_writers(db: sqlite3.Connection, files: CacheFiles) -> int:
    """Remove the rows (and any renamed object) and temp files of writers that died."""
    reaped = 0
    rows = db.execute("SELECT scope, id, writer FROM entries WHERE writer IS NOT NULL").fetchall()
    for scope, chunk_id, writer in rows:
        token = WriterToken.parse(str(writer))
        if token is not None and token.alive():
            continue
        files.unlink(scope, chunk_id)
        db.execute("DELETE FROM entries WHERE scope = ? AND id = ?", (scope, chunk_id))
        reaped += 1
    for name in files.temp_names():
        if not temp_writer_alive(name):
            files.remove_temp(name)
    if reaped:
        log.info("chunk cache %s: removed %d objects whose writers died", files.root, reaped)
        _recount(db)
    return reaped


def repair(db: sqlite3.Connection, files: CacheFiles, *, full: bool) -> None:
    """Put the cache right at open (see the module); ``full`` also reconciles the files."""
    reap_dead_writers(db, files)
    if full:
        _reconcile(db, files)
    _recount(db)


def _reconcile(db: sqlite3.Connection, files: CacheFiles) -> None:
    known = {
        (str(r[0]), str(r[1])): r[2]
        for r in db.execute("SELECT scope, id, writer FROM entries").fetchall()
    }
    adopted = 0
    on_disk: set[tuple[str, str]] = set()
    for scope, chunk_id, size, mtime_ns in files.walk():
        on_disk.add((scope, chunk_id))
        if (scope, chunk_id) not in known:
            db.execute(
                "INSERT INTO entries (scope, id, size, last_used, writer) "
                "VALUES (?, ?, ?, ?, NULL)",
                (scope, chunk_id, size, mtime_ns),
            )
            db.execute("INSERT OR IGNORE INTO scopes (scope, label) VALUES (?, '')", (scope,))
            adopted += 1
    lost = [key for key, writer in known.items() if writer is None and key not in on_disk]
    db.executemany("DELETE FROM entries WHERE scope = ? AND id = ?", lost)
    if adopted or lost:
        log.info(
            "chunk cache %s: index rebuilt from the files (%d adopted, %d rows without a file)",
            files.root,
            adopted,
            len(lost),
        )


def _recount(db: sqlite3.Connection) -> None:
    db.execute(
        "UPDATE totals SET n = (SELECT COALESCE(SUM(size), 0) FROM entries) WHERE name = 'used'"
    )
