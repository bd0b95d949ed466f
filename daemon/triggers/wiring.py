"""Plugs triggers, policy, logind and the migration board into the running daemon.

``gpusnap.daemon.main`` calls ``start_triggers(service, config)`` after the service is up and
attaches what it returns (``service.attach_triggers``); the service then calls ``status``,
``migrations``, ``drill`` and, at stop, ``stop``. Everything the trigger code needs from the
service goes through ``ServiceRunner`` (the policy's ``CheckpointRunner``) and two callables
for the standby loop (``service.compat``, ``service.restore`` + ``service.wait_job``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from gpusnap.daemon import sdnotify
from gpusnap.daemon.jobs.job import Job
from gpusnap.daemon.migration import (
    MigrationBoard,
    MigrationClaim,
    MigrationConfig,
    MigrationRequest,
    StandbyLoop,
    default_node_id,
    parse_migration_config,
)
from gpusnap.daemon.triggers.base import Notice, TriggerManager
from gpusnap.daemon.triggers.config import TriggersConfig, build_watchers, parse_triggers_config
from gpusnap.daemon.triggers.policy import PolicyEngine, drill_notice, parse_workload_policy
from gpusnap.daemon.triggers.shutdown import (
    LogindInhibitor,
    StopTimeoutExtender,
    sigterm_notice,
    system_is_stopping,
)
from gpusnap.daemon.verdict import CompatVerdict
from gpusnap.errors import FailedPrecondition, GpusnapError

log = logging.getLogger(__name__)

DRILL_DEFAULT_DEADLINE_S = 120.0
STOP_RECLAIM_BUDGET_S = 120.0  # how long stop waits for a reclaim checkpoint


class Service(Protocol):
    """The parts of ``DaemonService`` used here."""

    config: Any
    store: Any  # StoreHandle: .get() -> CheckpointStore

    def checkpoint(
        self,
        *,
        workload: str | None = None,
        leave_running: bool = False,
        trigger: str = "operator",
        deadline: float | None = None,
        compress: bool | None = None,
    ) -> Job: ...

    def restore(self, *, checkpoint_id: str | None = None) -> Job: ...

    def compat(self, checkpoint_id: str) -> CompatVerdict: ...

    def wait_job(self, job_id: str, timeout: float) -> Job: ...

    def cancel_job(self, job_id: str) -> Job: ...

    def get_job(self, job_id: str) -> Job: ...


class ServiceRunner:
    """The policy's ``CheckpointRunner`` over the daemon service."""

    def __init__(self, service: Service) -> None:
        self._service = service

    def checkpoint(
        self,
        *,
        workload: str,
        leave_running: bool,
        trigger: str,
        deadline: float | None,
        compress: bool,
    ) -> Job:
        return self._service.checkpoint(
            workload=workload,
            leave_running=leave_running,
            trigger=trigger,
            deadline=deadline,
            compress=compress,
        )

    def wait_job(self, job_id: str, timeout: float) -> Job:
        return self._service.wait_job(job_id, timeout)

    def cancel_job(self, job_id: str) -> None:
        self._service.cancel_job(job_id)


class TriggersRuntime:
    """What ``start_triggers`` returns: the service's handle on triggers and migration."""

    def __init__(
        self,
        service: Service,
        tcfg: TriggersConfig,
        mcfg: MigrationConfig,
    ) -> None:
        self._service = service
        self.tcfg = tcfg
        self.mcfg = mcfg
        # [migration] node_id, else the daemon's own node_id, else the host name: two
        # daemons on one host (or a renamed node) must not take each other for themselves.
        daemon_id = getattr(getattr(service.config, "daemon", None), "node_id", None)
        self.node_id = mcfg.node_id or daemon_id or default_node_id()
        policies = [parse_workload_policy(w.name, w.policy) for w in service.config.workloads]
        self.engine = PolicyEngine(ServiceRunner(service), policies, on_committed=self._publish)
        watchers, detail = build_watchers(tcfg)
        self.manager = TriggerManager(
            watchers, self.engine.on_notice, max_backoff=tcfg.max_backoff, detail=detail
        )
        self.inhibitor: LogindInhibitor | None = None
        self.logind_error: str | None = None
        self.standby: StandbyLoop | None = None
        self._stop = threading.Event()
        self._board: MigrationBoard | None = None
        self._board_lock = threading.Lock()

    # --- the store's migration board, opened when the store is reachable -----------------------

    def board(self) -> MigrationBoard:
        with self._board_lock:
            if self._board is None:
                store = self._service.store.get()
                self._board = MigrationBoard(
                    store.backend, store, claim_timeout_s=self.mcfg.claim_timeout
                )
            return self._board

    def _publish(self, notice: Notice, job: Job) -> None:
        cid = job.result.get("checkpoint_id")
        if not isinstance(cid, str):
            log.error(
                "%s: committed job %s has no checkpoint id; not published", job.workload, job.id
            )
            return
        summary: dict[str, Any] = {"trigger": notice.trigger, "notice": notice.detail}
        try:
            summary["stamp"] = self._service.store.get().manifest(cid).stamp
        except GpusnapError as exc:
            log.warning("%s: stamp not read for the migration request: %s", cid, exc)
        self.board().publish(cid, job.workload, self.node_id, summary, deadline=notice.deadline)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
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
        if self.mcfg.standby and not self._store_verifies():
            # A standby acts on what the store says (restore, or cold-start a launch spec as
            # root): never on records and manifests it cannot authenticate.
            log.error(
                "[migration] standby = true is ignored: [store] verify = false, and this node "
                "does not adopt workloads from a store it does not authenticate"
            )
        elif self.mcfg.standby:
            threading.Thread(target=self._start_standby, name="standby-start", daemon=True).start()

    def _store_verifies(self) -> bool:
        store = getattr(self._service.config, "store", None)
        return bool(getattr(store, "verify", True))

    def _start_standby(self) -> None:
        while not self._stop.is_set():
            try:
                board = self.board()
            except GpusnapError as exc:
                log.warning("migration standby waits for the store: %s", exc)
                self._stop.wait(self.mcfg.poll_interval)
                continue
            self.standby = StandbyLoop(
                board,
                self.node_id,
                self._service.compat,
                self._restore,
                cold_start_after_s=self.mcfg.cold_start_after,
                poll_interval_s=self.mcfg.poll_interval,
            )
            self.standby.start()
            log.info("migration standby on as node %s", self.node_id)
            return

    def _restore(self, req: MigrationRequest, claim: MigrationClaim) -> Job:
        job = self._service.restore(checkpoint_id=req.checkpoint_id)
        return self._service.wait_job(job.id, self.mcfg.claim_timeout)

    def stop(self) -> None:
        """At daemon stop: if the node is going down, checkpoint first (kill mode)."""
        self._stop.set()
        if system_is_stopping():
            self.manager.submit(sigterm_notice(STOP_RECLAIM_BUDGET_S))
        if self.engine.reclaim_in_flight():
            log.warning("stopping: waiting for reclaim checkpoints to commit")
            StopTimeoutExtender(sdnotify.extend_timeout, self.engine.reclaim_in_flight).run(
                STOP_RECLAIM_BUDGET_S
            )
        self.engine.stop()
        self.manager.stop()
        if self.standby is not None:
            self.standby.stop()
        if self.inhibitor is not None:
            self.inhibitor.close()

    # --- what the service shows ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out = self.manager.state_dict()
        out.update(
            {
                "running": True,
                "provider": self._provider(),
                "node_id": self.node_id,
                "workloads": self.engine.state(),
                "logind": {
                    "held": self.inhibitor.held if self.inhibitor else False,
                    "delay_max_s": self.inhibitor.delay_max_s if self.inhibitor else None,
                    "error": self.logind_error,
                },
                "standby": {
                    "enabled": self.mcfg.standby,
                    "running": self.standby is not None,
                    "last_error": self.standby.last_error if self.standby else None,
                },
            }
        )
        return out

    def _provider(self) -> str:
        providers = {w.provider for w in self.manager.watchers}
        return ",".join(sorted(providers)) or "none"

    def migrations(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.board().statuses()]

    def drill(self, deadline_s: float | None) -> Job:
        notice = drill_notice(DRILL_DEFAULT_DEADLINE_S if deadline_s is None else deadline_s)
        self.manager.submit(notice)
        ids = self.engine.jobs_for(notice, timeout=30.0)
        if not ids:
            raise FailedPrecondition(
                "drill started no checkpoint: no workload has on_notice = checkpoint, "
                "or every one is already reclaimed"
            )
        return self._service.get_job(ids[0])


def start_triggers(service: Any, config: Any) -> TriggersRuntime:
    """Build and start triggers, policy, logind and (``standby = true``) the standby loop."""
    tcfg = config.triggers
    if not isinstance(tcfg, TriggersConfig):
        tcfg = parse_triggers_config(tcfg or {})
    mcfg = config.migration
    if not isinstance(mcfg, MigrationConfig):
        mcfg = parse_migration_config(mcfg or {})
    runtime = TriggersRuntime(service, tcfg, mcfg)
    runtime.start()
    return runtime
