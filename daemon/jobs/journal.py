"""The job journal: every checkpoint and restore job, in SQLite in the state directory.

One row per job, rewritten as the job moves (state, phase, progress, result as JSON). The
database runs in WAL mode so a reader never blocks the writer and a crash loses at most the
last progress update. When the daemon starts, jobs a previous daemon left QUEUED or RUNNING are
marked INTERRUPTED; what they left in staging is settled by ``daemon/pipelines/recovery.py``,
which adds what it did to the job's one line. Nothing can be
half-committed in the store: a checkpoint exists only once its manifest is written, last.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpusnap.daemon.jobs.job import Job, JobKind, JobState, Phase, Progress
from gpusnap.errors import Unavailable

log = logging.getLogger(__name__)

INTERRUPTED_MESSAGE = "daemon restarted during the job"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,
    seq         INTEGER NOT NULL,
    kind        TEXT NOT NULL,
    workload    TEXT NOT NULL,
    state       TEXT NOT NULL,
    phase       TEXT NOT NULL,
    progress    TEXT NOT NULL,
    created_at  REAL NOT NULL,
    started_at  REAL,
    finished_at REAL,
    trigger     TEXT NOT NULL,
    deadline    REAL,
    error       TEXT,
    error_kind  TEXT,
    result      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_seq ON jobs (seq);
"""


class Journal:
    """Thread-safe access to ``<state_dir>/jobs.sqlite``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise Unavailable(f"job journal {path}: {exc}") from exc
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM jobs").fetchone()
        self._seq = int(row[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def save(self, job: Job) -> None:
        """Insert or replace the row of ``job``."""
        with self._lock:
            seq_row = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (job.id,)).fetchone()
            if seq_row is None:
                self._seq += 1
                seq = self._seq
            else:
                seq = int(seq_row[0])
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        job.id,
                        seq,
                        job.kind.value,
                        job.workload,
                        job.state.value,
                        job.phase.value,
                        json.dumps(asdict(job.progress)),
                        job.created_at,
                        job.started_at,
                        job.finished_at,
                        job.trigger,
                        job.deadline,
                        job.error,
                        job.error_kind,
                        json.dumps(job.result, default=str),
                    ),
                )
            except sqlite3.Error as exc:
                # The job goes on; losing one journal write only loses a progress update.
                log.warning("job journal: cannot save job %s: %s", job.id, exc)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _row_to_job(row)

    def recent(self, limit: int = 50) -> list[Job]:
        """The newest ``limit`` jobs, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs ORDER BY seq DESC LIMIT ?", (max(0, limit),)
            ).fetchall()
        return [_row_to_job(r) for r in rows]

    def recover(self) -> list[Job]:
        """Mark every job a previous daemon left unfinished INTERRUPTED; return them."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE state IN (?, ?)",
                (JobState.QUEUED.value, JobState.RUNNING.value),
            ).fetchall()
        jobs = [_row_to_job(r) for r in rows]
        now = time.time()
        for job in jobs:
            job.state = JobState.INTERRUPTED
            job.error = INTERRUPTED_MESSAGE
            job.error_kind = "unavailable"
            job.finished_at = now
            self.save(job)
            log.warning(
                "job %s (%s of %s) was interrupted by a daemon restart in phase %s",
                job.id,
                job.kind.value,
                job.workload,
                job.phase.value,
            )
        return jobs


def _row_to_job(row: tuple[Any, ...]) -> Job:
    (
        job_id,
        _seq,
        kind,
        workload,
        state,
        phase,
        progress,
        created_at,
        started_at,
        finished_at,
        trigger,
        deadline,
        error,
        error_kind,
        result,
    ) = row
    prog = json.loads(progress)
    return Job(
        id=job_id,
        kind=JobKind(kind),
        workload=workload,
        state=JobState(state),
        phase=Phase(phase),
        progress=Progress(
            bytes_done=int(prog.get("bytes_done", 0)),
            bytes_total=int(prog.get("bytes_total", 0)),
            rate_bytes_per_s=float(prog.get("rate_bytes_per_s", 0.0)),
        ),
        created_at=created_at,
        started_at=started_at,
        finished_at=finished_at,
        trigger=trigger,
        deadline=deadline,
        error=error,
        error_kind=error_kind,
        result=json.loads(result),
    )
