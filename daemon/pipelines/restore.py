"""The body of a process tree's restore job, its steps in order.

Authenticated manifest -> compatibility gate -> on any reason, cold start with every reason;
else pull into staging -> CRIU restore detached -> GPU restore -> report pids.

The body sees the node (``node.Node``) and its job (``JobContext``), never the service.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from typing import Any

from gpusnap.daemon.gate.container_stamp import is_container
from gpusnap.daemon.gate.verdict import Reason
from gpusnap.daemon.host import coldstart, proctree, scopes
from gpusnap.daemon.host.criu import can_punch_holes, remove_logs, systemd_running
from gpusnap.daemon.jobs.executor import JobContext
from gpusnap.daemon.jobs.job import Phase
from gpusnap.daemon.node.node import Node
from gpusnap.daemon.pipelines.container_restore import (
    fetch_figures,
    pull_into_staging,
    restore_device_memory,
    run_container_restore,
)
from gpusnap.daemon.pipelines.gpu_tree import give_up
from gpusnap.daemon.pipelines.hooks import JobHooks
from gpusnap.errors import FailedPrecondition, GpusnapError, InvalidArgument, NotFound
from gpusnap.storage import CheckpointStore, Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestorePlan:
    """What a restore job restores: a checkpoint by id, or a workload's latest."""

    checkpoint_id: str | None
    workload: str | None
    name: str | None = None  # a container checkpoint restored under another name
    allow_rollback: bool = False  # the latest may be older than the head records promise


def run_restore(node: Node, ctx: JobContext, plan: RestorePlan) -> None:
    job_started = ctx.created_at
    # Refused at submission too; checked again here, where the manifest is acted on.
    node.require_verified("restore")
    store = node.store.get()
    ctx.phase(Phase.COMPAT)
    manifest = _manifest(store, plan)  # authenticated: Corrupt if altered or unsigned
    if ctx.workload != manifest.workload:
        ctx.set_workload(manifest.workload)
    ctx.result(checkpoint_id=manifest.checkpoint_id)
    if is_container(manifest.stamp):
        run_container_restore(node, ctx, manifest, name=plan.name)
        return
    if plan.name is not None:
        raise InvalidArgument(
            f"--name is for container checkpoints; {manifest.checkpoint_id} is a process tree's"
        )

    reasons = node.reasons(manifest)
    if reasons:
        _cold_start(node, ctx, manifest, reasons)
        return

    process = manifest.stamp.get("process") or {}
    pids = [int(p) for p in process.get("pids", []) if isinstance(p, int)]
    for pid in pids:
        if proctree.pid_in_use(pid):
            raise FailedPrecondition(
                f"pid {pid} of the checkpointed tree is in use here by "
                f"{proctree.holder(pid)}; CRIU restores processes with their original pids: "
                "stop (and reap) that process first"
            )

    staging = node.dirs.job_staging(ctx.job_id)
    images = staging / "images"
    restore_log = node.dirs.logs / f"{ctx.job_id}-restore.log"
    try:
        # Accepted -> the pull starts: the manifest, the compatibility gate, the pid check.
        prepare = time.time() - job_started
        pulled = pull_into_staging(store, ctx, manifest.checkpoint_id, images)
        ctx.phase(Phase.RESTORE_PROCESS)
        # From here the tree runs (or is being made to): a cancel could only orphan it.
        ctx.cancellable = False
        sibling = not systemd_running()
        restored = node.criu.restore(
            images,
            log_path=restore_log,
            pidfile=staging / "restore.pid",
            scope_unit=scopes.unit_name(manifest.workload, ctx.job_id),
            scope_description=scopes.description(manifest.workload, manifest.checkpoint_id),
            sibling=sibling,
            # Punch each page out of the staging images once restored: the restored memory
            # reuses the pages the pull just filled (warm) instead of touching fresh ones,
            # and the node never holds the images and the restored memory at once. Only
            # where the staging filesystem can punch holes (CRIU fails the restore if not).
            extra_args=("--auto-dedup",) if can_punch_holes(staging) else (),
        )
        if sibling:
            for pid in {restored.pid, *pids}:
                node.adopt(pid)
        ctx.phase(Phase.RESTORE_GPU)
        gpu_stamp = manifest.stamp.get("gpu")
        try:
            streamed = restore_device_memory(
                node,
                pids or [restored.pid],
                gpu_stamp if isinstance(gpu_stamp, dict) else {},
                store,
                manifest,
            )
        except GpusnapError as err:  # no retry exists: the restored tree is lost
            _cold_start(node, ctx, manifest, [give_up(err, [restored.pid, *pids])])
            return
        tree = [restored.pid, *[p for p in pids if p != restored.pid]]
        ctx.result(
            mode="restored",
            pids=tree,
            reasons=[],
            prepare_seconds=round(prepare, 6),
            **fetch_figures(pulled, streamed),
            restore_seconds=round(restored.wall_seconds, 6),
            # CRIU's own account (--display-stats): its time restoring, pages it wrote.
            criu_restore_time_seconds=round(restored.stats.get("Restore time", 0) / 1e6, 6),
            criu_pages_restored=restored.stats.get("Pages restored", 0),
            seconds=round(time.time() - job_started, 6),
        )
        wcfg = node.config.workload(manifest.workload)
        hooks = JobHooks.for_job(wcfg, manifest.workload, ctx, node.dirs.logs)
        hooks.post_restore(tree, manifest.checkpoint_id)
        remove_logs(restore_log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _manifest(store: CheckpointStore, plan: RestorePlan) -> Manifest:
    checkpoint_id = plan.checkpoint_id
    if checkpoint_id is None:
        assert plan.workload is not None
        latest = store.latest_checked(plan.workload, allow_rollback=plan.allow_rollback).summary
        if latest is None:
            raise NotFound(f"workload {plan.workload} has no checkpoint in the store")
        checkpoint_id = latest.checkpoint_id
    return store.manifest(checkpoint_id)


def _cold_start(node: Node, ctx: JobContext, manifest: Manifest, reasons: list[Reason]) -> None:
    """The checkpoint does not fit this node: run the workload fresh, and say why."""
    job_started = ctx.created_at
    wcfg = node.config.workload(manifest.workload)
    spec = (
        coldstart.from_config(wcfg.start)
        if wcfg is not None and wcfg.start is not None
        else coldstart.from_stamp(manifest.stamp.get("launch"))
    )
    ctx.phase(Phase.COLD_START)
    log.warning(
        "checkpoint %s does not fit this node: %s; cold-starting %s",
        manifest.checkpoint_id,
        "; ".join(r.message for r in reasons),
        manifest.workload,
    )
    log_path = node.dirs.logs / f"{manifest.workload}-{ctx.job_id}.log"
    proc = coldstart.launch(spec, log_path)
    node.adopt(proc.pid, proc)
    details: list[dict[str, Any]] = [
        {"field": r.field, "expected": r.expected, "actual": r.actual, "message": r.message}
        for r in reasons
    ]
    ctx.result(
        mode="cold-start",
        pids=[proc.pid],
        reasons=[r.message for r in reasons],
        reason_details=details,
        launch_source=spec.source,
        log=str(log_path),
        seconds=round(time.time() - job_started, 6),
    )
