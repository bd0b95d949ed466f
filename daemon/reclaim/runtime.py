"""``ReclaimRuntime``: watchers, policy, logind and the migration board, running in one daemon.

The daemon builds it from itself (as a ``NodeDaemon``, ``reclaim/node.py``, which
``DaemonService`` satisfies as it is) and its typed config, calls ``start()``, holds it, and
calls ``status``, ``migrations``, ``withdraw``, ``drill``, ``on_job_finished`` (as each job
ends) and, at stop, ``stop``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import Any

from gpusnap.daemon.infra import sdnotify
from gpusnap.daemon.jobs.job import Job, JobKind, JobState
from gpusnap.daemon.reclaim.board import (
    MigrationBoard,
    MigrationClaim,
    MigrationRequest,
    StoreRecords,
)
from gpusnap.daemon.reclaim.config import MigrationConfig, TriggersConfig, WorkloadPolicy
from gpusnap.daemon.reclaim.manager import TriggerManager
from gpusnap.daemon.reclaim.node import NodeDaemon
from gpusnap.daemon.reclaim.notice import Notice, drill_notice
from gpusnap.daemon.reclaim.policy import PolicyEngine
from gpusnap.daemon.reclaim.prefetch import PrefetchFollower
from gpusnap.daemon.reclaim.providers import build_watchers
from gpusnap.daemon.reclaim.shutdown import (
    LogindInhibitor,
    StopTimeoutExtender,
    sigterm_notice,
    system_is_stopping,
)
from gpusnap.daemon.reclaim.standby import StandbyLoop
from gpusnap.errors import FailedPrecondition, GpusnapError

log = logging.getLogger(__name__)

DRILL_DEFAULT_DEADLINE_S = 120.0
STOP_RECLAIM_BUDGET_S = 120.0  # how long stop waits for a reclaim checkpoint


class ReclaimRuntime:
    """The daemon's handle on triggers, policy and migration.

    ``policies``: one per configured workload; ``daemon_node_id``: ``[daemon] node_id``;
    ``store_verifies``: ``[store] verify`` (a standby never adopts from a store it does not
    authenticate). Nothing runs until ``start()``.
    """

    def __init__(
        self,
        node: NodeDaemon,
        triggers: TriggersConfig,
        migration: MigrationConfig,
        policies: Iterable[WorkloadPolicy],
        *,
        daemon_node_id: str | None,
        store_verifies: bool,
    ) -> None:
        policies = list(policies)
        self._node = node
        self.tcfg = triggers
        self.mcfg = migration
        self._store_verifies = store_verifies
        # [migration] node_id, else the daemon's own node_id, else the host name: two
        # daemons on one host (or a renamed node) must not take each other for themselves.
        self.node_id = migration.node_id or daemon_node_id or socket.gethostname()
        self.engine = PolicyEngine(node, policies, on_committed=self._publish)
        watchers, detail = build_watchers(triggers)
        self.manager = TriggerManager(
            watchers, self.engine.on_notice, max_backoff=triggers.max_backoff, detail=detail
        )
        self.inhibitor: LogindInhibitor | None = None
        self.logind_error: str | None = None
        self.standby: StandbyLoop | None = None
        # [migration] prefetch: the latest checkpoint of each workload this node stands by
        # for, kept warm in its chunk cache (prefetch_workloads, else every configured one).
        self.prefetch: PrefetchFollower | None = None
        self._prefetch_workloads = migration.prefetch_workloads or tuple(
            p.workload for p in policies
        )
        # Each look at the board finds the store again: ``Unavailable`` while it is not
        # reachable (at start too), and the board there again once it is.
        self.board = MigrationBoard(
            StoreRecords(node.store.get),
            claim_timeout_s=migration.claim_timeout,
            request_ttl_s=migration.request_ttl,
        )

    def _publish(self, notice: Notice, job: Job) -> None:
        cid = job.result.get("checkpoint_id")
        if not isinstance(cid, str):
            log.error(
                "%s: committed job %s has no checkpoint id; not published", job.workload, job.id
            )
            return
        summary: dict[str, Any] = {"trigger": notice.trigger, "notice": notice.detail}
        try:
            summary["stamp"] = self._node.store.get().manifest(cid).stamp
        except GpusnapError as exc:
            log.warning("%s: stamp not read for the migration request: %s", cid, exc)
        self.board.publish(cid, job.workload, self.node_id, summary, deadline=notice.deadline)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the watchers, the periodic scheduler, logind's lock and (``standby = true``)
        the standby loop."""
        self.manager.start()
        self.engine.start()
        if self.tcfg.logind:
            inhibitor = LogindInhibitor(self.manager.submit)
            try:
                inhibitor.start()
                self.inhibitor = inhibitor
            except GpusnapError as exc:
                self.logind_error = str(exc)
                log.info("logind shutdown lock not taken: %s", exc)
        if self.mcfg.standby and not self._store_verifies:
            # A standby acts on what the store says (restore, or cold-start a launch spec as
            # root): never on records and manifests it cannot authenticate.
            log.error(
                "[migration] standby = true is ignored: [store] verify = false, and this node "
                "does not adopt workloads from a store it does not authenticate"
            )
        elif self.mcfg.standby:
            self.standby = StandbyLoop(
                self.board,
                self.node_id,
                self._node.compat,
                self._restore,
                cold_start_after_s=self.mcfg.cold_start_after,
                poll_interval_s=self.mcfg.poll_interval,
                latest=self._latest,
            )
            self.standby.start()
            log.info("migration standby on as node %s", self.node_id)
        if self.mcfg.prefetch:
            self._start_prefetch()

    def _start_prefetch(self) -> None:
        if not self._prefetch_workloads:
            log.warning("[migration] prefetch = true, but there is no workload to follow")
            return
        self.prefetch = PrefetchFollower(
            self._node.store,
            self._prefetch_workloads,
            bandwidth=self.mcfg.prefetch_bandwidth,
            poll_interval_s=self.mcfg.poll_interval,
        )
        self.prefetch.start()
        log.info(
            "prefetching the latest checkpoints of %s at up to %.0f bytes/s",
            ", ".join(self._prefetch_workloads),
            self.mcfg.prefetch_bandwidth,
        )

    def _latest(self, workload: str) -> str | None:
        summary = self._node.store.get().latest(workload)
        return summary.checkpoint_id if summary is not None else None

    def on_job_finished(self, job: Job) -> None:
        """A checkpoint committed or a restore done here supersedes the pending migration
        requests of its workload: it runs (or ran) on after them, and a standby adopting one
        would start a stale copy. The daemon calls this as each job ends."""
        if job.state is not JobState.SUCCEEDED or not job.workload:
            return
        cid = job.result.get("checkpoint_id")
        if job.kind is JobKind.CHECKPOINT and isinstance(cid, str):
            why = f"checkpoint {cid} of {job.workload} (job {job.id} on {self.node_id}) is newer"
            self.board.supersede(job.workload, self.node_id, why, keep=cid)
        elif job.kind is JobKind.RESTORE:
            how = "cold-started" if job.result.get("mode") == "cold-start" else "restored"
            why = f"{job.workload} was {how} on {self.node_id} by job {job.id}"
            self.board.supersede(job.workload, self.node_id, why)

    def withdraw(self, checkpoint_id: str, reason: str = "") -> dict[str, Any]:
        """``gpusnap migrations withdraw ID``: no standby adopts that request after this."""
        return self.board.withdraw(checkpoint_id, self.node_id, reason).to_dict()

    def _restore(self, req: MigrationRequest, claim: MigrationClaim) -> Job:
        job = self._node.restore(checkpoint_id=req.checkpoint_id)
        return self._node.wait_job(job.id, self.mcfg.claim_timeout)

    def stop(self) -> None:
        """At daemon stop: if the node is going down, checkpoint first (kill mode)."""
        if system_is_stopping():
            self.manager.submit(sigterm_notice(STOP_RECLAIM_BUDGET_S))
        if self.engine.reclaim_in_flight():
            log.warning("stopping: waiting for reclaim checkpoints to commit")
            StopTimeoutExtender(sdnotify.extend_timeout, self.engine.reclaim_in_flight).run(
                STOP_RECLAIM_BUDGET_S
            )
        self.engine.stop()
        self.manager.stop()
        if self.prefetch is not None:
            self.prefetch.stop()
        if self.standby is not None:
            self.standby.stop()
        if self.inhibitor is not None:
            self.inhibitor.close()

    # --- what the daemon shows ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What ``gpusnap triggers`` shows (its ``--json`` keys)."""
        out = self.manager.state_dict()
        out.update(
            {
                "running": True,
                "provider": self.provider(),
                "node_id": self.node_id,
                "workloads": self.engine.state(),
                "logind": {
                    "held": self.inhibitor.held if self.inhibitor else False,
                    "delay_max_s": self.inhibitor.delay_max_s if self.inhibitor else None,
                    "error": self.logind_error,
                },
                "standby": {
                    "enabled": self.mcfg.standby,
                    # Running once it has read the board: until the store first answers it
                    # is not, and ``last_error`` says why.
                    "running": self.standby is not None and self.standby.has_looked,
                    "last_error": self.standby.last_error if self.standby else None,
                    "looks": self.standby.looks if self.standby else 0,
                    "request_ttl_s": self.mcfg.request_ttl,
                },
                "prefetch": (
                    self.prefetch.state()
                    if self.prefetch is not None
                    else {"enabled": self.mcfg.prefetch, "workloads": []}
                ),
            }
        )
        return out

    def provider(self) -> str:
        """The clouds whose notices are watched ("aws", "gcp,azure"), or "none"."""
        providers = {w.provider for w in self.manager.watchers}
        return ",".join(sorted(providers)) or "none"

    def migrations(self) -> list[dict[str, Any]]:
        """Every migration on the board, as ``gpusnap migrations`` shows it."""
        return [s.to_dict() for s in self.board.statuses()]

    def drill(self, deadline_s: float | None) -> Job:
        """Run the reclaim path as if a notice with ``deadline_s`` left had arrived; the
        first reclaim job it started or attached to."""
        notice = drill_notice(DRILL_DEFAULT_DEADLINE_S if deadline_s is None else deadline_s)
        self.manager.submit(notice)
        ids = self.engine.jobs_for(notice, timeout=30.0)
        if not ids:
            raise FailedPrecondition(
                "drill started no checkpoint: no workload has on_notice = checkpoint, "
                "or every one is already reclaimed"
            )
        return self._node.get_job(ids[0])
