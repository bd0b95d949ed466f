"""A job: what one checkpoint or restore request became, as the executor, the journal and the
API see it (kind, state, phase, progress, result).

The service decides; the servicer translates these to and from protobuf messages. Keep this
module free of I/O.
"""

from __future__ import annotations

import enum
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

# What ``new_job_id`` makes: the time it was made (UTC) and six hex digits.
JOB_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{6}")


def new_job_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


class JobKind(enum.StrEnum):
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"  # the daemon died while the job ran; recovered at start

    @property
    def terminal(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)


class Phase(enum.StrEnum):
    PENDING = "pending"
    FREEZE_GPU = "freeze-gpu"
    DUMP = "dump"
    THAW = "thaw"
    UPLOAD = "upload"
    COMMIT = "commit"
    FETCH = "fetch"
    COMPAT = "compat"
    RESTORE_PROCESS = "restore-process"
    RESTORE_GPU = "restore-gpu"
    COLD_START = "cold-start"
    DONE = "done"


@dataclass
class Progress:
    bytes_done: int = 0
    bytes_total: int = 0
    rate_bytes_per_s: float = 0.0


@dataclass
class Job:
    id: str
    kind: JobKind
    workload: str
    state: JobState = JobState.QUEUED
    phase: Phase = Phase.PENDING
    progress: Progress = field(default_factory=Progress)
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    trigger: str = "operator"  # operator | schedule | reclaim:aws | reclaim:gcp | ... | drill
    deadline: float | None = None  # epoch seconds by which the commit must land
    error: str | None = None  # one line
    error_kind: str | None = None
    # Filled as the job goes; keys are stable and mirrored in the CLI's --json output.
    #   checkpoint: checkpoint_id, pause_seconds, seconds, bytes_total, bytes_uploaded,
    #               chunks_total, chunks_uploaded, committed_before_deadline
    #   restore:    checkpoint_id, mode ("restored" | "cold-start"), pids, reasons, seconds
    result: dict[str, Any] = field(default_factory=dict)
