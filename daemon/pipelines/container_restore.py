"""The body of a restore job for a container checkpoint, called by ``restore.py``.

Compatibility gate (host, GPU and container rules) -> on any reason, a cold start with every
reason: the node's ``start`` for the workload when it declares one, else a fresh container
created from the recorded config (its image must be here: gpusnap never pulls) -> else pull
the parts into staging -> the runtime restores the container (same name by default, or
``name``) into this node's storage -> GPU restore of its CUDA processes on their new host pids
(UUID-remapped) and unlock -> report the container and its pids.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers import ContainerInfo, ContainerRuntime, load_parts
from gpusnap.daemon.containers.openfiles import log_fitted
from gpusnap.daemon.gate.container_stamp import (
    recorded_container,
    recorded_ns_pids,
    remap_gpu_stamp,
)
from gpusnap.daemon.gate.verdict import Reason
from gpusnap.daemon.host import coldstart, proctree
from gpusnap.daemon.infra.metrics import METRICS
from gpusnap.daemon.jobs.executor import JobContext
from gpusnap.daemon.jobs.job import Phase
from gpusnap.daemon.node.node import Node
from gpusnap.daemon.pipelines.gpu_memory import committed_source
from gpusnap.errors import AlreadyExists, Corrupt, GpusnapError, NotFound, with_message
from gpusnap.storage import CheckpointStore, Manifest
from gpusnap.storage.pull import PullResult, PullStats
from gpusnap.storage.streams import GPU_MEMORY_KIND

log = logging.getLogger(__name__)


def pull_into_staging(
    store: CheckpointStore, ctx: JobContext, checkpoint_id: str, dest: Path
) -> PullResult:
    """A restore's FETCH phase (a process tree's too): the checkpoint but its GPU memory pulled
    into ``dest``, and counted in the metrics. CRIU or the runtime reads it once and it is thrown
    away: through the page cache, not synced."""
    ctx.phase(Phase.FETCH)
    pulled = store.pull(
        checkpoint_id,
        dest,
        progress=ctx.progress,
        exclude_kinds=(GPU_MEMORY_KIND,),
        direct=False,
        durable=False,
    )
    METRICS.observe_fetch("restore", fetched=pulled.bytes_fetched, cached=pulled.bytes_cached)
    return pulled


def fetch_figures(pulled: PullResult, streamed: PullStats) -> dict[str, Any]:
    """What a restore's result says of its fetch: the pull's time, and the staged files and the
    device memory streams together: from the store, from the node's chunk cache instead, and
    their logical size."""
    return {
        "fetch_seconds": round(pulled.seconds, 6),
        "bytes_fetched": pulled.bytes_fetched + streamed.bytes_fetched,
        "bytes_cached": pulled.bytes_cached + streamed.bytes_cached,
        "bytes_total": pulled.bytes_total + streamed.bytes_total,
    }


def restore_device_memory(
    node: Node,
    pids: list[int],
    gpu_stamp: dict[str, Any],
    store: CheckpointStore,
    manifest: Manifest,
) -> PullStats:
    """A restore's RESTORE_GPU phase (a process tree's too): the processes' device memory back
    on this node's GPUs, what it read of the store counted in the metrics (raised or not).
    Returns what it read (device memory streams with custom storage; none otherwise)."""
    streamed = PullStats()
    try:
        node.gpu.restore(pids, gpu_stamp, source=committed_source(store, manifest, streamed))
    finally:
        METRICS.observe_fetch(
            "restore", fetched=streamed.bytes_fetched, cached=streamed.bytes_cached
        )
    return streamed


def run_container_restore(
    node: Node, ctx: JobContext, manifest: Manifest, *, name: str | None
) -> None:
    job_started = ctx.created_at
    stamp = manifest.stamp
    recorded = recorded_container(stamp)
    store = node.store.get()
    reasons = node.reasons(manifest)
    if reasons:
        _cold_start(node, ctx, manifest, recorded, reasons, name=name)
        return

    rt = node.containers.get(recorded.runtime)
    staging = node.dirs.job_staging(ctx.job_id)
    dest = staging / "container"
    try:
        prepare = time.time() - job_started
        pulled = pull_into_staging(store, ctx, manifest.checkpoint_id, dest)
        parts = load_parts(dest)
        if parts.container.id != recorded.id:
            raise Corrupt(
                f"checkpoint {manifest.checkpoint_id}: its parts are of container "
                f"{parts.container.id}, its stamp names {recorded.id}"
            )
        ctx.phase(Phase.RESTORE_PROCESS)
        # From here the container runs (or is being made to): a cancel could only orphan it.
        ctx.cancellable = False
        t0 = time.monotonic()
        fitted = rt.fit_open_files(parts, name=name)
        log_fitted(name or parts.container.name, fitted)
        info = rt.restore(parts, name=name)
        restore_seconds = time.monotonic() - t0
        ctx.phase(Phase.RESTORE_GPU)
        gpu_stamp = stamp.get("gpu")
        streamed = restore_device_memory(
            node,
            list(info.pids),
            remap_gpu_stamp(
                gpu_stamp if isinstance(gpu_stamp, dict) else {},
                recorded_ns_pids(stamp),
                proctree.ns_pids(info.pids),
            ),
            store,
            manifest,
        )
        ctx.result(
            mode="restored",
            pids=list(info.pids),
            reasons=[],
            container=info.summary(),
            # Files of the rw layer cut back to CRIU's record (containers/openfiles.py).
            fitted_files=[f.as_dict() for f in fitted],
            prepare_seconds=round(prepare, 6),
            **fetch_figures(pulled, streamed),
            restore_seconds=round(restore_seconds, 6),
            seconds=round(time.time() - job_started, 6),
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _cold_start(
    node: Node,
    ctx: JobContext,
    manifest: Manifest,
    recorded: ContainerInfo,
    reasons: list[Reason],
    *,
    name: str | None,
) -> None:
    """The checkpoint does not fit this node: start the workload fresh, and say why."""
    job_started = ctx.created_at
    ctx.phase(Phase.COLD_START)
    why = "; ".join(r.message for r in reasons)
    log.warning(
        "checkpoint %s does not fit this node: %s; cold-starting %s",
        manifest.checkpoint_id,
        why,
        manifest.workload,
    )
    common: dict[str, Any] = {
        "mode": "cold-start",
        "reasons": [r.message for r in reasons],
        "reason_details": [
            {"field": r.field, "expected": r.expected, "actual": r.actual, "message": r.message}
            for r in reasons
        ],
    }
    wcfg = node.config.workload(manifest.workload)
    if wcfg is not None and wcfg.start is not None:
        log_path = node.dirs.logs / f"{manifest.workload}-{ctx.job_id}.log"
        proc = coldstart.launch(coldstart.from_config(wcfg.start), log_path)
        node.adopt(proc.pid, proc)
        ctx.result(
            **common,
            pids=[proc.pid],
            launch_source="config",
            log=str(log_path),
            seconds=round(time.time() - job_started, 6),
        )
        return
    target = name or recorded.name
    try:
        rt = node.containers.get(recorded.runtime)
        _make_room(rt, target, recorded)
        info = rt.create(recorded.spec, name=target)
    except GpusnapError as err:
        raise with_message(
            err,
            f"cannot cold-start container {target!r} from its recorded config ({err}); "
            f"the checkpoint does not fit this node: {why}",
        ) from err
    ctx.result(
        **common,
        pids=list(info.pids),
        launch_source="checkpoint",
        container=info.summary(),
        seconds=round(time.time() - job_started, 6),
    )


def _make_room(rt: ContainerRuntime, target: str, recorded: ContainerInfo) -> None:
    """Free the name ``target`` for a fresh container: the stopped checkpointed container is
    removed, anything else of that name is left alone and refused."""
    try:
        there = rt.inspect(target)
    except NotFound:
        return
    if there.running or there.id != recorded.id:
        raise AlreadyExists(
            f"{rt.name}: a {'running ' if there.running else ''}container is named {target!r}; "
            "restore with --name NEW"
        )
    rt.remove(there.id)
