"""The standby loop: a standby node adopts reclaimed workloads from the migration board.

Every ``poll_interval_s`` it looks at the board's pending requests (no outcome, no live claim,
not expired, not superseded, not this node's own); one whose workload has a newer checkpoint
in the store is superseded on the board instead of adopted. A node whose stamp matches claims
at once and restores; a node that does not match waits until the request is
``cold_start_after_s`` old, then claims it to cold-start the workload and records why. Each
claim ends in an outcome on the board; one the store refuses is kept and retried, since a
claim left without its outcome would be taken over after the claim timeout and the workload
started a second time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gpusnap.daemon.jobs.job import Job, JobState
from gpusnap.daemon.reclaim.board import (
    ClaimMode,
    MigrationBoard,
    MigrationClaim,
    MigrationOutcome,
    MigrationRequest,
)
from gpusnap.daemon.reclaim.polling import poll_until_stopped
from gpusnap.errors import AlreadyExists, GpusnapError

log = logging.getLogger(__name__)


class Verdict(Protocol):
    """What a standby reads of the compatibility gate's answer for a checkpoint (the daemon's
    ``gate/verdict.py:CompatVerdict``): whether it fits here, and why not."""

    @property
    def compatible(self) -> bool: ...
    @property
    def reasons(self) -> Sequence[object]: ...


CompatCheck = Callable[[str], Verdict]
RestoreRun = Callable[[MigrationRequest, MigrationClaim], Job]  # blocks until the job ends
LatestCheckpoint = Callable[[str], str | None]  # a workload's newest checkpoint in the store


class StandbyLoop:
    """Watches the board and adopts reclaimed workloads (``[migration] standby = true``)."""

    def __init__(
        self,
        board: MigrationBoard,
        node_id: str,
        compat: CompatCheck,
        restore: RestoreRun,
        *,
        cold_start_after_s: float = 120.0,
        poll_interval_s: float = 5.0,
        latest: LatestCheckpoint | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.board = board
        self.node_id = node_id
        self._compat = compat
        self._restore = restore
        self._latest = latest
        self.cold_start_after_s = cold_start_after_s
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.has_looked = False  # a look at the board has succeeded (the store answered)
        self.looks = 0  # looks at the board finished, every pending request considered
        # Outcomes of restores this node ran that the store has not taken yet (unreachable
        # when the job ended): retried first at every tick. Until one lands the claim stays
        # live, and a claim left without its outcome would be taken over after the claim
        # timeout and the workload started a second time.
        self._unrecorded: list[tuple[MigrationClaim, dict[str, Any]]] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="migration-standby", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # still in a look at the board: it keeps what it could not record
        # Outcomes still not recorded get one last try; one that does not land leaves its
        # claim live until the claim timeout, after which another node may act on it.
        self._record_unrecorded()
        for claim, _args in self._unrecorded:
            log.error(
                "%s: stopping with its migration outcome unrecorded (the store refused it); "
                "after [migration] claim_timeout another standby may adopt it again",
                claim.checkpoint_id,
            )

    def _run(self) -> None:
        poll_until_stopped(
            self.tick,
            self._stop,
            lambda: self.poll_interval_s,
            self._set_error,
            "migration standby",
        )

    def _set_error(self, error: str | None) -> None:
        self.last_error = error

    def tick(self) -> list[MigrationOutcome]:
        """One look at the board; returns the outcomes this node recorded."""
        done = self._record_unrecorded()
        pending = self.board.pending()
        self.has_looked = True
        for req in pending:
            if self._stop.is_set():
                break
            if req.source_node == self.node_id:
                continue  # the node going away does not adopt its own workload
            if self._superseded(req):
                continue
            outcome = self._consider(req)
            if outcome is not None:
                done.append(outcome)
        self.looks += 1
        return done

    def _superseded(self, req: MigrationRequest) -> bool:
        """A newer checkpoint of the workload is in the store: it ran on somewhere after the
        request, so adopting the request would start a stale copy. Ended on the board."""
        if self._latest is None:
            return False
        try:
            latest = self._latest(req.workload)
        except GpusnapError as exc:
            log.warning("%s: cannot ask for newer checkpoints: %s", req.checkpoint_id, exc)
            return True  # not now: the next look asks again
        if latest is None or latest == req.checkpoint_id:
            return False
        self.board.supersede(
            req.workload,
            self.node_id,
            f"checkpoint {latest} of {req.workload} is newer",
            keep=latest,
        )
        return True

    def _consider(self, req: MigrationRequest) -> MigrationOutcome | None:
        try:
            verdict = self._compat(req.checkpoint_id)
        except GpusnapError as exc:
            log.warning("%s: compatibility check failed: %s", req.checkpoint_id, exc)
            return None
        if verdict.compatible:
            mode: ClaimMode = "restore"
            reason = ""
        else:
            age = self._clock() - req.created_at
            if age < self.cold_start_after_s:
                log.debug("%s: not compatible; waiting for a matching node", req.checkpoint_id)
                return None
            mode = "cold-start"
            why = "; ".join(str(r) for r in verdict.reasons) or "stamp does not match"
            reason = f"no compatible node claimed within {self.cold_start_after_s:g} s; {why}"
        claim = self.board.claim(req.checkpoint_id, self.node_id, mode, reason=reason)
        if claim is None:
            return None
        try:
            job = self._restore(req, claim)
        except GpusnapError as exc:
            return self._record(claim, {"succeeded": False, "mode": "", "detail": str(exc)})
        ok = job.state == JobState.SUCCEEDED
        result_mode = str(job.result.get("mode", "restored" if mode == "restore" else mode))
        detail = reason if ok else (job.error or f"restore job ended {job.state}")
        return self._record(
            claim, {"succeeded": ok, "mode": result_mode, "detail": detail, "job_id": job.id}
        )

    def _record(self, claim: MigrationClaim, args: dict[str, Any]) -> MigrationOutcome | None:
        """Record an outcome; kept for the next tick when the store does not take it now."""
        try:
            return self.board.record_outcome(claim, **args)
        except AlreadyExists:
            raise  # another node's outcome: nothing of ours to keep retrying
        except GpusnapError as exc:
            log.warning(
                "%s: outcome not recorded yet (retried at the next look): %s",
                claim.checkpoint_id,
                exc,
            )
            self._unrecorded.append((claim, args))
            return None

    def _record_unrecorded(self) -> list[MigrationOutcome]:
        pending, self._unrecorded = self._unrecorded, []
        done: list[MigrationOutcome] = []
        for claim, args in pending:
            try:
                outcome = self._record(claim, args)
            except AlreadyExists as exc:
                log.warning("%s: %s", claim.checkpoint_id, exc)
                continue
            if outcome is not None:
                log.warning("%s: outcome recorded on retry", claim.checkpoint_id)
                done.append(outcome)
        return done
