"""What a daemon that died mid-job left behind, settled when the next one starts.

The journal marks the dead daemon's unfinished jobs interrupted (``jobs/journal.py``); what
each left in its staging directory is looked at here, before anything is deleted, because a
kill-mode checkpoint's images may be the only copy of its workload.

A checkpoint body writes ``dump.json`` into its staging just before CRIU runs
(``record_dump``): the workload, the mode, and the tree as (pid, start time) pairs of this
boot — a pid alone may have been reused by the time we look. CRIU's own run leaves
``criu-run.json`` while it runs (``host/criu_run.py``): a leftover dump died with the daemon;
a leftover restore is waited for (it finishes by itself) before its staging is touched.

For an interrupted kill-mode checkpoint, which way it went is read from the tree itself:

- every process of the tree runs: the dump never reached its kill stage (CRIU died with the
  daemon and the tree resumed). Nothing to do; the staging is removed.
- the tree is gone, or partly gone, and the images are complete (``inventory.img``: CRIU writes
  it last, flushes every image, and only then kills the tree): the survivors (same pid and
  start time) are killed and the tree is restored on this node from the images, as a failed
  upload's rescue does (``rescue.py``); where that fails the images are kept in
  ``<state_dir>/kept/<job>``.
- the tree is gone and the images are not complete: nothing can bring it back; the job says so.

Unless the checkpoint was committed after all (the store's latest checkpoint of the workload
names this job): the job succeeded, and the workload is left stopped, as that checkpoint
expects. Nor is a tree restored when it may run twice: after a reboot (another boot id) or
when the workload's own config finds it running again (its service manager restarted it), the
images are kept and the job says where. What was done is appended to the job's one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.criu_run import RunRecord
from gpusnap.daemon.host.target import workload_root
from gpusnap.daemon.jobs.job import JOB_ID, Job, JobKind, JobState, Phase
from gpusnap.daemon.jobs.journal import Journal
from gpusnap.daemon.node.node import Node
from gpusnap.daemon.pipelines.rescue import Rescue
from gpusnap.errors import GpusnapError

log = logging.getLogger(__name__)

DUMP_RECORD = "dump.json"
LEFTOVER_CRIU_WAIT_S = 300.0  # a leftover criu restore finishing; against hangs only
SURVIVOR_REAP_WAIT_S = 10.0  # their parents reaping killed survivors; CRIU says if not
_POLL_S = 0.1


@dataclass(frozen=True)
class DumpRecord:
    """What a checkpoint body was about to dump, as ``dump.json`` in its staging says."""

    workload: str
    leave_running: bool
    boot_id: str
    tree: list[tuple[int, int]]  # (pid, start time), root first
    cuda_pids: list[int] = field(default_factory=list)
    gpu: dict[str, Any] = field(default_factory=dict)  # the stamp's gpu section
    gpu_memory_in_store: bool = False

    def alive(self) -> list[int]:
        """The pids of the tree that still run as the same processes."""
        return [
            pid
            for pid, start in self.tree
            if proctree.exists(pid) and proctree.start_time(pid) == start
        ]

    @classmethod
    def read(cls, staging: Path) -> DumpRecord | None:
        try:
            data = json.loads((staging / DUMP_RECORD).read_text())
            return cls(
                workload=str(data["workload"]),
                leave_running=bool(data["leave_running"]),
                boot_id=str(data["boot_id"]),
                tree=[(int(p), int(s)) for p, s in data["tree"]],
                cuda_pids=[int(p) for p in data.get("cuda_pids", [])],
                gpu=dict(data.get("gpu") or {}),
                gpu_memory_in_store=bool(data.get("gpu_memory_in_store", False)),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable %s: %s", staging / DUMP_RECORD, exc)
            return None


def record_dump(
    staging: Path,
    *,
    workload: str,
    leave_running: bool,
    pids: list[int],
    cuda_pids: list[int] | None = None,
    gpu: dict[str, Any] | None = None,
    gpu_memory_in_store: bool = False,
) -> None:
    """Write ``dump.json`` for the tree ``pids`` (root first), just before CRIU dumps it."""
    tree = [(pid, start) for pid in pids if (start := proctree.start_time(pid)) is not None]
    record = DumpRecord(
        workload=workload,
        leave_running=leave_running,
        boot_id=proctree.boot_id(),
        tree=tree,
        cuda_pids=list(cuda_pids or []),
        gpu=dict(gpu or {}),
        gpu_memory_in_store=gpu_memory_in_store,
    )
    tmp = staging / (DUMP_RECORD + ".tmp")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(asdict(record), default=str) + "\n")
        os.replace(tmp, staging / DUMP_RECORD)
    except OSError as exc:
        # The dump itself says whether staging is usable; without the record, a daemon that
        # dies now leaves the next one only the journal to go by.
        log.warning("cannot write %s: %s", staging / DUMP_RECORD, exc)


def recover(node: Node, journal: Journal) -> list[Job]:
    """Mark the dead daemon's jobs interrupted, settle what each left in staging, then remove
    the staging that is left. Returns the interrupted jobs (with what was done in ``error``)."""
    jobs = journal.recover()
    by_id = {job.id: job for job in jobs}
    staging = node.dirs.staging
    for entry in sorted(staging.iterdir()) if staging.is_dir() else []:
        if not JOB_ID.fullmatch(entry.name) or not entry.is_dir() or entry.is_symlink():
            continue
        job = by_id.get(entry.name)
        try:
            outcome = _settle(node, entry, job)
        except Exception:  # one job's leftovers must not stop the daemon from starting
            log.exception("recovery of %s failed; its staging is kept", entry)
            continue
        if outcome is None:
            continue  # a criu still works there: left in place
        if job is not None and outcome.line:
            outcome.apply(job)
            journal.save(job)
        log.warning("job %s: %s", entry.name, outcome.line or "leftover staging removed")
        shutil.rmtree(entry, ignore_errors=True)
    node.dirs.clean_staging()
    return jobs


@dataclass
class _Outcome:
    line: str
    committed: str | None = None  # the checkpoint the job did commit, after all

    def apply(self, job: Job) -> None:
        if self.committed is not None:
            job.state, job.phase = JobState.SUCCEEDED, Phase.DONE
            job.error = job.error_kind = None
            job.result.update(checkpoint_id=self.committed, recovered=self.line)
        else:
            job.error = f"{job.error}; {self.line}"


def _settle(node: Node, staging: Path, job: Job | None) -> _Outcome | None:
    run = RunRecord.read(staging)
    if run is not None and not _wait_gone(run):
        log.warning(
            "a criu %s (pid %d) still runs in %s after %.0fs; its staging is left alone",
            run.what,
            run.pid,
            staging,
            LEFTOVER_CRIU_WAIT_S,
        )
        return None
    if job is not None and job.kind is JobKind.RESTORE:
        return _Outcome(_restore_outcome(staging, run))
    record = DumpRecord.read(staging)
    if record is None:
        return _Outcome("")  # killed before the dump began: nothing was touched
    return _checkpoint_outcome(node, staging, record)


def _wait_gone(run: RunRecord) -> bool:
    end = time.monotonic() + LEFTOVER_CRIU_WAIT_S
    while run.running():
        if time.monotonic() > end:
            return False
        time.sleep(_POLL_S)
    return True


def _restore_outcome(staging: Path, run: RunRecord | None) -> str:
    try:
        pid = int((staging / "restore.pid").read_text().strip())
    except (OSError, ValueError):
        pid = 0
    if pid and proctree.exists(pid):
        return f"its criu restore finished after the daemon died: the tree runs (pid {pid})"
    if run is not None:
        return "its criu restore did not bring the tree up: restore again"
    return ""


def _checkpoint_outcome(node: Node, staging: Path, record: DumpRecord) -> _Outcome:
    root = record.tree[0][0] if record.tree else 0
    alive = record.alive()
    if record.leave_running or (record.tree and len(alive) == len(record.tree)):
        if record.leave_running:
            return _Outcome(f"the workload was left running (pid {root})" if alive else "")
        return _Outcome(
            f"the dump did not finish and the workload runs on (pid {root})" + _cuda_note(record)
        )
    images = staging / "images"
    if not (images / "inventory.img").is_file():
        return _Outcome(
            "the workload's tree is gone and its dump did not finish: nothing to restore"
        )
    committed = _committed(node, record.workload, staging.name)
    if committed is not None:
        return _Outcome(
            f"checkpoint {committed} was committed before the daemon died; the workload "
            "stays stopped, as a kill-mode checkpoint leaves it",
            committed=committed,
        )
    rescue = Rescue(
        node,
        staging.name,
        images,
        freeze=_Frozen(record.cuda_pids if not record.gpu_memory_in_store else []),
        gpu_stamp=record.gpu,
        workload=record.workload,
    )
    if record.boot_id != proctree.boot_id():
        return _Outcome(f"the node rebooted since; {rescue.keep_images()}, not restored")
    again = _running_again(node, record.workload)
    if again is not None:
        return _Outcome(
            f"the workload runs again (pid {again}, started afresh); {rescue.keep_images()},"
            " not restored"
        )
    _kill(alive)  # what CRIU's kill stage did not reach: the images are the workload now
    return _Outcome(f"the dump had finished: {rescue.run()}")


def _kill(pids: list[int]) -> None:
    """Kill the survivors of a dumped tree and give their parents a moment to reap them: CRIU
    restores the tree with its pids, which a zombie still holds."""
    for pid in pids:
        log.warning("killing pid %d, a survivor of a dumped tree", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + SURVIVOR_REAP_WAIT_S
    while any(proctree.pid_in_use(p) for p in pids) and time.monotonic() < end:
        time.sleep(_POLL_S)


@dataclass
class _Frozen:
    """A freeze as the record tells it (what ``Rescue`` asks of one)."""

    cuda_pids: list[int]

    def to_stamp(self) -> dict[str, Any]:
        return {}


def _cuda_note(record: DumpRecord) -> str:
    if not record.cuda_pids:
        return ""
    return (
        f"; its CUDA processes {record.cuda_pids} may still be locked and checkpointed "
        "by the GPU freeze (gpusnap does not thaw them at start)"
    )


def _committed(node: Node, workload: str, job_id: str) -> str | None:
    try:
        store = node.store.get()
        latest = store.latest(workload)
        if latest is None:
            return None
        manifest = store.manifest(latest.checkpoint_id)
    except GpusnapError as err:
        log.warning("cannot ask the store whether job %s committed: %s", job_id, err)
        return None
    return manifest.checkpoint_id if manifest.extra.get("job") == job_id else None


def _running_again(node: Node, workload: str) -> int | None:
    wcfg = node.config.workload(workload)
    if wcfg is None or (wcfg.pid_file is None and wcfg.systemd_unit is None and wcfg.match is None):
        return None
    try:
        return workload_root(wcfg)
    except GpusnapError:
        return None
