"""The body of a checkpoint job: the steps of DESIGN.md, in order.

Look at the tree -> GPU freeze -> CRIU dump into staging -> (leave-running: GPU thaw; the
pause ends here) -> stamp -> push to the store (manifest last) -> clean staging.

The store is asked for the workload's latest checkpoint (the parent) *before* the dump, so an
unreachable store fails the job while the workload is still untouched. If the upload of a
kill-mode dump fails, the workload is restored on this node from the local images — its GPU
state too — so a failed checkpoint never loses it (``rescue.py``).

The body sees the node (``node.Node``) and its job (``JobContext``), never the service.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from typing import Any

from gpusnap.daemon.config import WorkloadConfig
from gpusnap.daemon.gpu_memory import MemoryUploads
from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.criu import remove_logs
from gpusnap.daemon.host.files import watched_files
from gpusnap.daemon.host.pagestream import PageStreamer
from gpusnap.daemon.jobs.executor import JobContext
from gpusnap.daemon.jobs.job import Phase
from gpusnap.daemon.metrics import METRICS
from gpusnap.daemon.node import Node
from gpusnap.daemon.rescue import Rescue
from gpusnap.daemon.stamp import checkpoint_stamp, file_entry, identity_stamp
from gpusnap.errors import GpusnapError, with_message
from gpusnap.storage.streams import UploadedStreams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPlan:
    """What the service decided a checkpoint job takes, and how."""

    root_pid: int
    workload: str
    config: WorkloadConfig | None
    leave_running: bool
    compress: bool | None = None


@dataclass(frozen=True)
class _Look:
    """The tree as it was before the freeze: what the stamp records of it."""

    tree: list[proctree.ProcessInfo]
    launch: dict[str, Any]
    engine: dict[str, Any]
    model: dict[str, Any]
    watched: list[tuple[str, str]]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.tree]


def run_checkpoint(node: Node, ctx: JobContext, plan: CheckpointPlan) -> None:
    job_started = ctx.created_at
    store = node.store.get()
    # Ask the store first: an unreachable store fails here, before the workload is touched.
    latest = store.latest(plan.workload)
    parent = latest.checkpoint_id if latest is not None else None

    look = _look(plan)
    pids = look.pids
    host = node.host.get()
    gpu_stamp = dict(node.gpu.stamp())

    staging = node.dirs.job_staging(ctx.job_id)
    images = staging / "images"
    dump_log = node.dirs.logs / f"{ctx.job_id}-dump.log"
    seed = node.config.cache.seed  # what this node pushes, its chunk cache holds
    gpu_memory = MemoryUploads(store, seed_cache=seed)
    pages: PageStreamer | None = None
    try:
        ctx.phase(Phase.FREEZE_GPU)
        t_freeze = time.monotonic()
        freeze = node.gpu.freeze(pids, custom_storage=gpu_memory.custom_storage())
        gpu_pause = time.monotonic() - t_freeze if freeze.cuda_pids else 0.0

        ctx.phase(Phase.DUMP)
        # Accepted -> CRIU starts: queueing, the store's latest, the look at the tree, stamps.
        prepare = time.time() - job_started
        # A first checkpoint uploads everything: overlap that with the dump (a later one
        # follows its parent's chunks, which makes its upload cheap after the dump).
        if parent is None and node.config.daemon.upload_during_dump:
            pages = PageStreamer(store, images, compress=plan.compress, seed_cache=seed)
            pages.start()
        try:
            dump = node.criu.dump(
                look.tree[0].pid, images, leave_running=plan.leave_running, log_path=dump_log
            )
        except GpusnapError:
            if pages is not None:
                pages.abort()
            if freeze.cuda_pids:
                _thaw_after_failure(node, freeze)
            raise
        if not plan.leave_running:
            # The tree is gone; from here on cancelling would lose the workload.
            ctx.cancellable = False
        if plan.leave_running and freeze.cuda_pids:
            ctx.phase(Phase.THAW)
            t_thaw = time.monotonic()
            node.gpu.thaw(freeze)
            gpu_pause += time.monotonic() - t_thaw
        pause = dump.pause_seconds + gpu_pause
        ctx.result(
            pause_seconds=round(pause, 6),
            dump_seconds=round(dump.wall_seconds, 6),
            prepare_seconds=round(prepare, 6),
            # CRIU's own account: most of the pause is writing the pages into staging.
            criu_memory_write_seconds=round(dump.stats.get("Memory write time", 0) / 1e6, 6),
            images_bytes=dump.images_bytes,
            pids=pids,
        )

        # The files are stat'ed after the dump: a killed tree can no longer change them.
        files = [e for path, kind in look.watched if (e := file_entry(path, kind)) is not None]
        gpu_stamp.update(freeze.to_stamp())
        stamp = checkpoint_stamp(
            host=host,
            engine=look.engine,
            model=look.model,
            files=files,
            launch=look.launch,
            gpu=gpu_stamp,
            tree=look.tree,
        )
        spec: dict[str, Any] = {
            "workload": plan.workload,
            "launch": look.launch,
            "leave_running": plan.leave_running,
            "trigger": ctx.trigger,
        }

        ctx.phase(Phase.UPLOAD)
        uploaded = _uploaded_streams(gpu_memory.uploaded, pages)
        try:
            pushed = store.push(
                images,
                workload=plan.workload,
                parent=parent,
                stamp=stamp,
                spec=spec,
                progress=ctx.progress,
                compress=plan.compress,
                extra={"job": ctx.job_id, "pause_seconds": round(pause, 6)},
                uploaded_streams=uploaded,
                seed_cache=seed,
            )
        except GpusnapError as err:
            if not plan.leave_running:
                rescued = Rescue(
                    node,
                    ctx.job_id,
                    images,
                    freeze=freeze,
                    gpu_stamp=stamp["gpu"],
                    gpu_memory_in_store=gpu_memory.uploaded is not None,
                ).run()
                raise with_message(err, f"{err}; {rescued}") from err
            raise
        ctx.phase(Phase.COMMIT)
        committed = time.time()
        result: dict[str, Any] = {
            "checkpoint_id": pushed.checkpoint_id,
            "parent": parent,
            "seconds": round(committed - job_started, 6),
            "upload_seconds": round(pushed.seconds, 6),
            "bytes_total": pushed.bytes_total,
            "bytes_uploaded": pushed.bytes_uploaded,
            "chunks_total": pushed.chunks_total,
            "chunks_uploaded": pushed.chunks_uploaded,
            "leave_running": plan.leave_running,
        }
        if ctx.deadline is not None:
            result["committed_before_deadline"] = committed <= ctx.deadline
        ctx.result(**result)
        METRICS.set_last_checkpoint(plan.workload, committed)
        remove_logs(dump_log)
    finally:
        if pages is not None:
            pages.abort()  # a no-op once finished; else it must stop reading staging
        shutil.rmtree(staging, ignore_errors=True)


def _look(plan: CheckpointPlan) -> _Look:
    """The tree, its launch spec, its identity and its files, read from /proc."""
    tree = proctree.process_tree(plan.root_pid)
    root = tree[0]
    launch = proctree.launch_spec(root.pid)
    launch["exe"] = root.exe
    packages: dict[str, str] = {}
    if plan.config is None or plan.config.engine is None:
        try:
            packages = proctree.python_packages(root.pid)
        except GpusnapError as err:
            log.info("cannot probe the packages of pid %d: %s", root.pid, err)
    engine, model = identity_stamp(plan.config, packages)
    watched = watched_files([p.pid for p in tree])
    return _Look(tree=tree, launch=launch, engine=engine, model=model, watched=watched)


def _uploaded_streams(
    gpu: UploadedStreams | None, pages: PageStreamer | None
) -> UploadedStreams | None:
    """What the push names besides the staging files: GPU memory and page images uploaded
    while CRIU wrote them (``finish`` waits for the rest of them to go up)."""
    streamed = pages.finish() if pages is not None else None
    if streamed is None or not streamed.entries:
        return gpu
    if gpu is None:
        return streamed
    merged = UploadedStreams()
    merged.merge(gpu)
    merged.merge(streamed)
    return merged


def _thaw_after_failure(node: Node, freeze: Any) -> None:
    try:
        node.gpu.thaw(freeze)
    except GpusnapError as err:
        log.warning("GPU thaw after a failed dump failed too: %s", err)
