"""The body of a process tree's checkpoint job, its steps in order.

Look at the tree -> preflight (what CRIU would refuse: the job fails here, nothing frozen) ->
GPU freeze -> CRIU dump into staging -> (leave-running: GPU thaw; the pause ends here) -> stamp
-> push to the store (manifest last) -> clean staging.

The store is asked for the workload's latest checkpoint (the parent) *before* the dump, so an
unreachable store fails the job while the workload is still untouched. If the upload of a
kill-mode dump fails, the workload is restored on this node from the local images — its GPU
state too — so a failed checkpoint never loses it (``rescue.py``). A workload whose latest
checkpoint the store check found damaged gets a full push (``node/storecheck.py``).

The body sees the node (``node.Node``) and its job (``JobContext``), never the service.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from gpusnap.daemon.config.file import WorkloadConfig
from gpusnap.daemon.gate.model_digest import DigestCache, cache_in, model_dir_stamp
from gpusnap.daemon.gate.stamp import checkpoint_stamp, file_entry, identity_stamp
from gpusnap.daemon.gpu.adapter import Freeze
from gpusnap.daemon.host import owners, preflight, proctree
from gpusnap.daemon.host.criu import remove_logs
from gpusnap.daemon.host.files import watched_files
from gpusnap.daemon.host.owners import tree_uids
from gpusnap.daemon.host.pagestream import PageStreamer
from gpusnap.daemon.infra.metrics import METRICS
from gpusnap.daemon.jobs.executor import JobContext
from gpusnap.daemon.jobs.job import Phase
from gpusnap.daemon.node.node import Node
from gpusnap.daemon.node.storecheck import StoreChecker
from gpusnap.daemon.pipelines import progress
from gpusnap.daemon.pipelines.gpu_memory import MemoryUploads
from gpusnap.daemon.pipelines.gpu_tree import nccl_by_pid, with_processes
from gpusnap.daemon.pipelines.hooks import JobHooks
from gpusnap.daemon.pipelines.recovery import record_dump
from gpusnap.daemon.pipelines.rescue import Rescue
from gpusnap.errors import GpusnapError, PermissionDenied, with_message
from gpusnap.storage import CheckpointStore
from gpusnap.storage.push import PushResult
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
    # The store check: whether this workload's latest checkpoint is damaged (a full push).
    store_check: StoreChecker | None = None
    # A caller who is not an administrator asked: every process must run as this uid when
    # the job looks at the tree (it may have changed since the request).
    run_as: int | None = None


@dataclass(frozen=True)
class _Look:
    """The tree as it was before the freeze: what the stamp records of it."""

    tree: list[proctree.ProcessInfo]
    launch: dict[str, Any]
    engine: dict[str, Any]
    model: dict[str, Any]
    watched: list[tuple[str, str]]
    uids: list[int]  # every uid the tree's processes had (real, effective, saved, fs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.tree]


def run_checkpoint(node: Node, ctx: JobContext, plan: CheckpointPlan) -> None:
    job_started = ctx.created_at
    store = node.store.get()
    # Ask the store first: an unreachable store fails here, before the workload is touched.
    latest = store.latest(plan.workload)
    parent = latest.checkpoint_id if latest is not None else None
    full = full_push_reason(plan.store_check, plan.workload, ctx)

    look = _look(plan, cache_in(node.dirs.state))
    pids = look.pids
    # What CRIU would refuse, refused here: nothing is frozen yet (host/preflight.py).
    preflight.require(node.criu, pids)
    nccl = nccl_by_pid(pids)  # while the tree runs: a kill-mode dump ends it
    hooks = JobHooks.for_job(plan.config, plan.workload, ctx, node.dirs.logs)
    hooks.pre_checkpoint(pids)  # a failure fails the job here: nothing is frozen yet
    host = node.host.get()
    gpu_stamp = dict(node.gpu.stamp())

    staging = node.dirs.job_staging(ctx.job_id)
    images = staging / "images"
    dump_log = node.dirs.logs / f"{ctx.job_id}-dump.log"
    seed = node.config.cache.seed  # what this node pushes, its chunk cache holds
    pages: PageStreamer | None = None
    try:
        freeze, gpu_pause, gpu_memory = freeze_gpu(node, ctx, store, pids, full=full is not None)

        ctx.phase(Phase.DUMP)
        # Accepted -> CRIU starts: queueing, the store's latest, the look at the tree, stamps.
        prepare = time.time() - job_started
        # What the next daemon needs to tell, should this one die, how far the dump got.
        record_dump(
            staging,
            workload=plan.workload,
            leave_running=plan.leave_running,
            pids=pids,
            cuda_pids=list(freeze.cuda_pids),
            gpu={**gpu_stamp, **freeze.to_stamp()},
            gpu_memory_in_store=gpu_memory.uploaded is not None,
        )
        if upload_during_dump(node, parent, full):
            pages = PageStreamer(
                store, images, compress=plan.compress, full=full is not None, seed_cache=seed
            )
            pages.start()
        with thawed_on_failure(node, freeze, pages), progress.dumping(ctx, images, pids):
            dump = node.criu.dump(
                look.tree[0].pid, images, leave_running=plan.leave_running, log_path=dump_log
            )
        gpu_pause += after_dump(node, ctx, freeze, leave_running=plan.leave_running)
        if plan.leave_running:
            hooks.post_thaw(pids)  # the pause is over: let the engine go on before the upload
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
        gpu_stamp.update(with_processes(freeze.to_stamp(), nccl))
        stamp = checkpoint_stamp(
            host=host,
            engine=look.engine,
            model=look.model,
            files=files,
            launch=look.launch,
            gpu=gpu_stamp,
            tree=look.tree,
            uids=look.uids,
        )
        spec: dict[str, Any] = {
            "workload": plan.workload,
            "launch": look.launch,
            "leave_running": plan.leave_running,
            "trigger": ctx.trigger,
        }

        ctx.phase(Phase.UPLOAD)
        # The whole checkpoint (progress.py): what is already in the store counts as done.
        gpu_bytes = gpu_memory.uploaded.bytes_total if gpu_memory.uploaded is not None else 0
        total = dump.images_bytes + gpu_bytes
        streamer = pages

        def in_store() -> int:
            return gpu_bytes + (streamer.bytes_streamed() if streamer is not None else 0)

        with progress.uploading(ctx, total, in_store):
            uploaded = _uploaded_streams(gpu_memory.uploaded, pages)
        streamed = uploaded.bytes_total if uploaded is not None else 0
        try:
            pushed = store.push(
                images,
                workload=plan.workload,
                parent=parent,
                stamp=stamp,
                spec=spec,
                progress=progress.push_progress(ctx, total, streamed),
                compress=plan.compress,
                extra={"job": ctx.job_id, "pause_seconds": round(pause, 6)},
                uploaded_streams=uploaded,
                full=full is not None,
                seed_cache=seed,
                deadline=ctx.deadline,
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
                    workload=plan.workload,
                ).run()
                raise with_message(err, f"{err}; {rescued}") from err
            raise
        ctx.phase(Phase.COMMIT)
        record_commit(
            ctx,
            pushed,
            workload=plan.workload,
            parent=parent,
            leave_running=plan.leave_running,
            full=full,
            store_check=plan.store_check,
        )
        remove_logs(dump_log)
    finally:
        hooks.after_checkpoint(pids)  # post_thaw, where a failure left the workload running
        if pages is not None:
            pages.abort()  # a no-op once finished; else it must stop reading staging
        shutil.rmtree(staging, ignore_errors=True)


def full_push_reason(
    store_check: StoreChecker | None, workload: str, ctx: JobContext
) -> str | None:
    """Why this checkpoint of ``workload`` (a process tree's or a container's) uploads every
    chunk (the store check found its latest checkpoint damaged), or None. Not with a
    deadline: a reclaim that uploads everything may miss it, and what it pushes is whole
    anyway (the push proves what it skips); the next checkpoint is full. Said in the job's
    result (``full_deferred``) and the log."""
    reason = store_check.full_reason(workload) if store_check is not None else None
    if reason is not None and ctx.deadline is not None:
        log.warning("checkpoint %s has a deadline: not a full one, though %s", ctx.job_id, reason)
        ctx.result(full_deferred=reason)
        return None
    if reason is not None:
        log.info("checkpoint %s uploads every chunk: %s", ctx.job_id, reason)
    return reason


def upload_during_dump(node: Node, parent: str | None, full: str | None) -> bool:
    """Whether the upload overlaps the dump (CRIU's, or a container runtime's export): for a
    checkpoint that uploads everything, a workload's first (no parent) or a full one, as
    ``[daemon] upload_during_dump`` allows. A later one follows its parent's chunks, which
    makes its upload cheap after the dump. What a full one streams goes up whole too (the
    streamer's ``full``): the push proves that a chunk skipped on the index's word exists,
    not that its bytes are good, and replacing those is what a full push is for."""
    return (parent is None or full is not None) and node.config.daemon.upload_during_dump


def _look(plan: CheckpointPlan, digests: DigestCache) -> _Look:
    """The tree, its launch spec, its identity and its files, read from /proc; the model
    directory's digest (before the freeze: reading weights must not lengthen the pause)."""
    tree = proctree.process_tree(plan.root_pid)
    if plan.run_as is not None:
        reasons = owners.tree_reasons([p.pid for p in tree], plan.run_as)
        if reasons:
            raise PermissionDenied(f"the tree no longer runs as uid {plan.run_as}: {reasons[0]}")
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
    declared = plan.config.model_dir if plan.config is not None else None
    model.update(model_dir_stamp(declared, launch, digests))
    watched = watched_files([p.pid for p in tree])
    uids = tree_uids([p.pid for p in tree])
    return _Look(tree=tree, launch=launch, engine=engine, model=model, watched=watched, uids=uids)


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


def freeze_gpu(
    node: Node, ctx: JobContext, store: CheckpointStore, pids: list[int], *, full: bool = False
) -> tuple[Freeze, float, MemoryUploads]:
    """The FREEZE_GPU phase of a checkpoint (a container's too): the CUDA processes of ``pids``
    locked and checkpointed. The freeze, the seconds it paused them (none when there were
    none), and where their device memory went (to ``store`` as it is read, where the driver
    lets it, every chunk of it for a ``full`` push; seeding this node's chunk cache as
    ``[cache] seed`` says)."""
    gpu_memory = MemoryUploads(store, full=full, seed_cache=node.config.cache.seed)
    ctx.phase(Phase.FREEZE_GPU)
    t_freeze = time.monotonic()
    freeze = node.gpu.freeze(pids, custom_storage=gpu_memory.custom_storage())
    gpu_pause = time.monotonic() - t_freeze if freeze.cuda_pids else 0.0
    return freeze, gpu_pause, gpu_memory


class _Abortable(Protocol):
    def abort(self) -> None: ...


@contextmanager
def thawed_on_failure(node: Node, freeze: Freeze, upload: _Abortable | None) -> Iterator[None]:
    """Around the dump (CRIU's or a runtime's): when it fails, the upload that followed it
    stops and the frozen processes get their GPU state back."""
    try:
        yield
    except GpusnapError:
        if upload is not None:
            upload.abort()
        if freeze.cuda_pids:
            thaw_after_failure(node, freeze)
        raise


def after_dump(node: Node, ctx: JobContext, freeze: Freeze, *, leave_running: bool) -> float:
    """After a good dump: a killed workload can no longer be cancelled (that would lose it); a
    running one gets its GPU state back (the THAW phase). The seconds the thaw paused it."""
    if not leave_running:
        ctx.cancellable = False
        return 0.0
    if not freeze.cuda_pids:
        return 0.0
    ctx.phase(Phase.THAW)
    t_thaw = time.monotonic()
    node.gpu.thaw(freeze)
    return time.monotonic() - t_thaw


def thaw_after_failure(node: Node, freeze: Any) -> None:
    """Give a freeze's processes their GPU state back after the dump failed (logged if not)."""
    try:
        node.gpu.thaw(freeze)
    except GpusnapError as err:
        log.warning("GPU thaw after a failed dump failed too: %s", err)


def record_commit(
    ctx: JobContext,
    pushed: PushResult,
    *,
    workload: str,
    parent: str | None,
    leave_running: bool,
    full: str | None = None,
    store_check: StoreChecker | None = None,
) -> None:
    """The committed checkpoint in the job's result (its id, sizes, times, whether before the
    deadline, whether a full one and why) and in the metrics; a full one is told to
    ``store_check`` (the workload's next checkpoint is incremental again)."""
    committed = time.time()
    result: dict[str, Any] = {
        "checkpoint_id": pushed.checkpoint_id,
        "parent": parent,
        "seconds": round(committed - ctx.created_at, 6),
        "upload_seconds": round(pushed.seconds, 6),
        "bytes_total": pushed.bytes_total,
        "bytes_uploaded": pushed.bytes_uploaded,
        "chunks_total": pushed.chunks_total,
        "chunks_uploaded": pushed.chunks_uploaded,
        "leave_running": leave_running,
        "full": full is not None,
    }
    if full is not None:
        result["full_reason"] = full
    if ctx.deadline is not None:
        result["committed_before_deadline"] = committed <= ctx.deadline
    ctx.result(**result)
    METRICS.set_last_checkpoint(workload, committed)
    if full is not None and store_check is not None:
        store_check.full_committed(workload, pushed.checkpoint_id)
