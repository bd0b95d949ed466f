"""The background store check, ``[store] check_interval``: restic's ``check`` on a schedule.

Every interval a thread at nice 19 asks the store whether every chunk its checkpoints name is
there (``CheckpointStore.check``: one LIST of the manifests, a GET of each, one LIST of the
chunks; no chunk is read). It checks **every checkpoint the store holds**, not only this
node's workloads': a store is shared by a fleet, a standby restores other nodes' workloads, a
lost chunk is every reader's problem, and an operator reading "the store check found nothing"
should be able to take it for the whole store.

What a check finds goes to
- the log: one error line per damaged checkpoint (its id, workload and missing chunks);
- the metrics (``daemon/infra/metrics.py``) and ``gpusnap status`` (``store_check``);
- the next checkpoint of each workload whose **latest** checkpoint is damaged, which is a full
  one: the push uploads every chunk whatever the index says (``store push --full``), and the
  job's result says ``full: true`` and why. The flag clears when such a checkpoint commits.
  A checkpoint with a deadline (a reclaim) is never made full, since uploading everything
  could cost the workload its checkpoint; it pushes what changed, which is still whole (the
  check dropped the missing chunks from the index, and a push proves every chunk it skips
  before it commits), and the full push waits for the next checkpoint without one.

The check holds no lock a job takes, so a checkpoint or restore never waits for it. A check
that fails (the store unreachable) is logged, counted, shown in the status, and tried again
one interval later; the daemon serves on.

The last check and the pending full checkpoints are kept in ``<state_dir>/store-check.json``
(replaced atomically), for the store URL they were found in. A restart keeps them: the status
still shows the damage, the next checkpoint is still full, and the schedule goes on from the
last check instead of starting over (a daemon restarted more often than the interval would
otherwise never check).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpusnap.daemon.infra.metrics import METRICS, MetricsRegistry, StoreCheckFigures
from gpusnap.daemon.node.node import StoreHandle
from gpusnap.errors import GpusnapError
from gpusnap.storage import ManifestSummary, StoreCheck

log = logging.getLogger(__name__)

STATE_FILE = "store-check.json"
_STATE_FORMAT = 1
NICE = 19  # the check is worth doing, never worth a checkpoint's time
STOP_WAIT = 5.0  # seconds ``stop`` waits for a check in flight (the thread is a daemon thread)


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A checkpoint that names chunks the store lacks: it cannot be restored as it is."""

    checkpoint_id: str
    workload: str
    missing_chunks: int
    latest: bool  # its workload's newest checkpoint (the parent of the next one)


@dataclass(frozen=True)
class CheckSummary:
    """What one store check found; the shape of the status, the metrics and the state file."""

    checked_at: float  # when it started (epoch seconds)
    seconds: float
    checkpoints_checked: int
    chunks_checked: int
    chunks_missing: int  # distinct chunks the damaged checkpoints name and the store lacks
    damaged: tuple[DamagedCheckpoint, ...] = ()
    manifests_bad: tuple[str, ...] = ()  # "id: why" for manifests that could not be read

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["damaged"] = [asdict(d) for d in self.damaged]
        out["manifests_bad"] = list(self.manifests_bad)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckSummary:
        """The inverse of ``as_dict``; ``ValueError`` for anything else."""
        try:
            damaged = tuple(
                DamagedCheckpoint(
                    checkpoint_id=_typed(d["checkpoint_id"], str),
                    workload=_typed(d["workload"], str),
                    missing_chunks=_typed(d["missing_chunks"], int),
                    latest=_typed(d["latest"], bool),
                )
                for d in data["damaged"]
            )
            return cls(
                checked_at=float(_typed(data["checked_at"], int | float)),
                seconds=float(_typed(data["seconds"], int | float)),
                checkpoints_checked=_typed(data["checkpoints_checked"], int),
                chunks_checked=_typed(data["chunks_checked"], int),
                chunks_missing=_typed(data["chunks_missing"], int),
                damaged=damaged,
                manifests_bad=tuple(_typed(m, str) for m in data["manifests_bad"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a store check: {exc!r}") from exc


def _typed(value: Any, kind: Any) -> Any:
    # bool is an int to isinstance: a count given as true is as wrong as one given as "1".
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{value!r} is not {kind}")
    return value


def summarize(
    check: StoreCheck, listed: list[ManifestSummary], unreadable: Collection[str] = ()
) -> CheckSummary:
    """``check`` with each damaged checkpoint's workload, and whether it is its workload's
    latest, from ``listed`` (the store's checkpoints newest first, listed after the check)
    and ``unreadable`` (the ids of the manifests that listing could not read).

    A checkpoint in neither was removed while the check ran (retention, whose gc then swept
    its chunks): it is no damage, its chunks are not counted missing, and its manifest
    vanishing under the check is no bad manifest.
    """
    workload_of: dict[str, str] = {}
    latest: dict[str, str] = {}
    for s in listed:
        workload_of[s.checkpoint_id] = s.workload
        latest.setdefault(s.workload, s.checkpoint_id)
    damaged: list[DamagedCheckpoint] = []
    missing: set[str] = set()
    for checkpoint_id in check.damaged:
        workload = workload_of.get(checkpoint_id)
        if workload is None:
            continue
        chunks = check.missing[checkpoint_id]
        missing.update(chunks)
        damaged.append(
            DamagedCheckpoint(
                checkpoint_id, workload, len(chunks), latest.get(workload) == checkpoint_id
            )
        )
    return CheckSummary(
        checked_at=check.checked_at,
        seconds=round(check.seconds, 6),
        checkpoints_checked=len(check.checkpoints),
        chunks_checked=check.chunks_checked,
        chunks_missing=len(missing),
        damaged=tuple(damaged),
        manifests_bad=tuple(
            bad
            for bad in check.manifests_bad
            if bad.partition(":")[0] in workload_of or bad.partition(":")[0] in unreadable
        ),
    )


def full_reason(damaged: DamagedCheckpoint, checked_at: float) -> str:
    """Why the next checkpoint of ``damaged``'s workload is a full one (the job's result)."""
    return (
        f"its latest checkpoint {damaged.checkpoint_id} names {damaged.missing_chunks} "
        f"chunk(s) the store lacks (store check at {_iso(checked_at)})"
    )


class StoreChecker:
    """The schedule, its findings and the pending full checkpoints; thread-safe.

    ``start`` runs the schedule (nothing when ``interval`` is 0); ``check_now`` runs one check
    on the caller's thread. The checkpoint body asks ``full_reason`` and, once such a
    checkpoint has committed, calls ``full_committed``.
    """

    def __init__(
        self,
        store: StoreHandle,
        *,
        interval: float,
        state_file: Path,
        store_url: str,
        metrics: MetricsRegistry = METRICS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.interval = interval
        self._store = store
        self._state_file = state_file
        self._store_url = store_url
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one write of the state file at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.native_id: int | None = None  # the check thread's, once it runs
        self._last: CheckSummary | None = None
        self._full: dict[str, str] = {}  # workload -> why its next checkpoint is full
        self._committed_at: dict[str, float] = {}  # workload -> its last full commit
        self._last_attempt: float | None = None
        self._error: str | None = None
        self._error_at: float | None = None
        self._load()

    # --- the schedule -------------------------------------------------------------------

    def start(self) -> None:
        if self.interval <= 0:
            log.info("store check off ([store] check_interval = 0)")
            return
        self._thread = threading.Thread(target=self._run, name="store-check", daemon=True)
        self._thread.start()
        log.info("store check every %gs, next at %s", self.interval, _iso(self._next_due()))

    def stop(self) -> None:
        """End the schedule; a check in flight gets ``STOP_WAIT`` seconds, then is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _next_due(self) -> float:
        with self._lock:
            last = self._last_attempt
        return self._clock() if last is None else last + self.interval

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        try:
            # Linux: a thread id names that thread alone, so only the check is niced.
            os.setpriority(os.PRIO_PROCESS, self.native_id, NICE)
        except OSError as exc:
            log.info("store check runs at normal priority: %s", exc)
        while not self._stop.wait(max(0.0, self._next_due() - self._clock())):
            self._attempt()

    def _attempt(self) -> None:
        try:
            self.check_now()
        except GpusnapError as err:
            if self._stop.is_set():  # the store closed under it at shutdown
                return
            with self._lock:
                self._error, self._error_at = str(err), self._last_attempt
            self._metrics.store_check_failed()
            log.warning("store check failed: %s; trying again in %gs", err, self.interval)
        except Exception:
            if self._stop.is_set():
                return
            # A bug must not end the schedule: the next interval tries again.
            with self._lock:
                self._error, self._error_at = "internal error (see the log)", self._last_attempt
            self._metrics.store_check_failed()
            log.exception("store check failed; trying again in %gs", self.interval)

    # --- one check ----------------------------------------------------------------------

    def check_now(self) -> CheckSummary:
        """Check the whole store now, on this thread; raises what the store raises."""
        with self._lock:
            self._last_attempt = self._clock()
        store = self._store.get()
        check = store.check(None)
        # Only damage needs the workloads and which checkpoint is each one's latest.
        listed: list[ManifestSummary] = []
        unreadable: list[str] = []
        if check.missing or check.manifests_bad:
            listed, skipped = store.list_checked()
            unreadable = [key.rpartition("/")[2] for key, _err in skipped]
        summary = summarize(check, listed, unreadable)
        self._record(summary)
        return summary

    def _record(self, summary: CheckSummary) -> None:
        full: dict[str, str] = {}
        with self._lock:
            for d in summary.damaged:
                # A full checkpoint committed after this check began is newer than what it saw.
                if d.latest and self._committed_at.get(d.workload, 0.0) < summary.checked_at:
                    full[d.workload] = full_reason(d, summary.checked_at)
            self._last = summary
            self._full = full
            self._error = self._error_at = None
        self._publish(summary)
        self._save()
        for d in summary.damaged:
            log.error(
                "store check: checkpoint %s of workload %s is DAMAGED: %d chunk(s) it names are "
                "missing from the store%s",
                d.checkpoint_id,
                d.workload,
                d.missing_chunks,
                "; it is the workload's latest, so its next checkpoint is a full one"
                if d.latest and d.workload in full
                else "",
            )
        for bad in summary.manifests_bad:
            log.warning("store check: manifest not read: %s", bad)
        log.info(
            "store check: %d checkpoint(s), %d chunk(s) checked in %.2fs; %d missing, "
            "%d damaged checkpoint(s)",
            summary.checkpoints_checked,
            summary.chunks_checked,
            summary.seconds,
            summary.chunks_missing,
            len(summary.damaged),
        )

    def _publish(self, summary: CheckSummary) -> None:
        self._metrics.set_store_check(
            StoreCheckFigures(
                checked_at=summary.checked_at,
                seconds=summary.seconds,
                chunks_missing=summary.chunks_missing,
                damaged=len(summary.damaged),
            )
        )

    # --- full checkpoints ---------------------------------------------------------------

    def full_reason(self, workload: str) -> str | None:
        """Why the next checkpoint of ``workload`` must be a full one; None: it need not."""
        with self._lock:
            return self._full.get(workload)

    def full_committed(self, workload: str, checkpoint_id: str) -> None:
        """A full checkpoint of ``workload`` committed: its next one is incremental again."""
        with self._lock:
            self._committed_at[workload] = self._clock()
            reason = self._full.pop(workload, None)
        if reason is not None:
            log.info("full checkpoint %s of %s committed (%s)", checkpoint_id, workload, reason)
            self._save()

    # --- what status shows --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``gpusnap status``'s ``store_check``; every key is a field of ``StoreCheckStatus``."""
        with self._lock:
            last, full = self._last, dict(self._full)
            error, error_at = self._error, self._error_at
        return {
            "interval_seconds": float(self.interval),
            "last_check_at": last.checked_at if last else None,
            "last_check_seconds": last.seconds if last else None,
            "next_check_at": self._next_due() if self.running else None,
            "checkpoints_checked": last.checkpoints_checked if last else 0,
            "chunks_checked": last.chunks_checked if last else 0,
            "chunks_missing": last.chunks_missing if last else 0,
            "damaged": [asdict(d) for d in last.damaged] if last else [],
            "manifests_bad": list(last.manifests_bad) if last else [],
            "error": error,
            "error_at": error_at,
            "full_next": full,
        }

    # --- the state file -----------------------------------------------------------------

    def _load(self) -> None:
        path = self._state_file
        try:
            state = _read_state(path, self._store_url)
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            log.warning("ignoring %s (%s): the store check starts afresh", path, exc)
            return
        if state is None:
            log.info("%s is of another store than %s; not used", path, self._store_url)
            return
        summary, full = state
        self._last, self._full = summary, full
        if summary is not None:
            self._last_attempt = summary.checked_at
            self._publish(summary)

    def _save(self) -> None:
        with self._save_lock:
            with self._lock:  # taken apart from the write: status never waits on an fsync
                data = {
                    "format": _STATE_FORMAT,
                    "store_url": self._store_url,
                    "last": self._last.as_dict() if self._last else None,
                    "full_next": dict(self._full),
                }
            try:
                _write_atomically(self._state_file, json.dumps(data, indent=1) + "\n")
            except OSError as exc:
                # Lost at a restart, found again by the next check: worth a warning, no more.
                log.warning("cannot keep the store check in %s: %s", self._state_file, exc)


def _read_state(path: Path, store_url: str) -> tuple[CheckSummary | None, dict[str, str]] | None:
    """The last check and the pending full checkpoints kept in ``path``; None when they are
    of another store. ``ValueError`` when the file is not one ``_save`` wrote."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != _STATE_FORMAT:
        raise ValueError(f"format is not {_STATE_FORMAT}")
    if data.get("store_url") != store_url:
        return None
    last = data.get("last")
    full = data.get("full_next")
    if not isinstance(full, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in full.items()
    ):
        raise ValueError("full_next is not a table of strings")
    return (None if last is None else CheckSummary.from_dict(last)), dict(full)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
