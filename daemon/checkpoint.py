"""The bodies of checkpoint and restore jobs: the steps of DESIGN.md, in order.

Checkpoint: look at the tree -> GPU freeze -> CRIU dump into staging -> (leave-running: GPU
thaw; the pause ends here) -> stamp -> push to the store (manifest last) -> clean staging.
The store is asked for the workload's latest checkpoint (the parent) *before* the dump, so an
unreachable store fails the job while the workload is still untouched. If the upload of a
kill-mode dump fails, the workload is restored on this node from the local images — its GPU
state too — so a failed checkpoint never loses it.

Restore: authenticated manifest -> compatibility gate -> on any reason, cold start with every
reason; else pull into staging -> CRIU restore detached -> GPU restore -> report pids.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusnap.daemon.config import WorkloadConfig
from gpusnap.daemon.host import coldstart, proctree
from gpusnap.daemon.host.criu import can_punch_holes, systemd_running
from gpusnap.daemon.host.pagestream import PageImageFollower
from gpusnap.daemon.jobs.executor import JobContext
from gpusnap.daemon.jobs.job import Phase
from gpusnap.daemon.stamp import STAMP_VERSION, file_entry, gpusnap_stamp, identity_stamp
from gpusnap.errors import FailedPrecondition, GpusnapError, NotFound, with_message
from gpusnap.storage.streams import GPU_MEMORY_KIND, UploadedStreams

if TYPE_CHECKING:
    from gpusnap.daemon.service import DaemonService
    from gpusnap.storage import CheckpointStore

log = logging.getLogger(__name__)

# Files whose content is the kernel's or a device's, not something a restore could find changed.
_PSEUDO_PREFIXES = ("/proc/", "/sys/", "/dev/", "/memfd:", "/anon_inode:")


@dataclass(frozen=True)
class CheckpointRequest:
    root_pid: int
    workload: str
    config: WorkloadConfig | None
    leave_running: bool
    compress: bool | None = None


@dataclass(frozen=True)
class RestoreRequest:
    checkpoint_id: str | None
    workload: str | None


# --- checkpoint ----------------------------------------------------------------------------------


def run_checkpoint(svc: DaemonService, ctx: JobContext, req: CheckpointRequest) -> None:
    job_started = ctx.created_at
    store = svc.store.get()
    # Ask the store first: an unreachable store fails here, before the workload is touched.
    latest = store.latest(req.workload)
    parent = latest.checkpoint_id if latest is not None else None

    tree = proctree.process_tree(req.root_pid)
    pids = [p.pid for p in tree]
    root = tree[0]
    launch = proctree.launch_spec(root.pid)
    launch["exe"] = root.exe
    packages: dict[str, str] = {}
    if req.config is None or req.config.engine is None:
        try:
            packages = proctree.python_packages(root.pid)
        except GpusnapError as err:
            log.info("cannot probe the packages of pid %d: %s", root.pid, err)
    engine, model = identity_stamp(req.config, packages)
    watched = _watched_files(pids)
    host = svc.host()
    gpu_stamp = dict(svc.gpu.stamp())

    staging = svc.staging_dir(ctx.job_id)
    images = staging / "images"
    dump_log = svc.logs_dir / f"{ctx.job_id}-dump.log"
    follower: PageImageFollower | None = None
    try:
        ctx.phase(Phase.FREEZE_GPU)
        t_freeze = time.monotonic()
        freeze = svc.gpu.freeze(pids, store=store)
        gpu_pause = time.monotonic() - t_freeze if freeze.cuda_pids else 0.0

        ctx.phase(Phase.DUMP)
        # Accepted -> CRIU starts: queueing, the store's latest, the look at the tree, stamps.
        prepare = time.time() - job_started
        # A first checkpoint uploads everything: overlap that with the dump (a later one
        # follows its parent's chunks, which makes its upload cheap after the dump).
        if parent is None and svc.config.daemon.upload_during_dump:
            follower = PageImageFollower(store, images, compress=req.compress)
            follower.start()
        try:
            dump = svc.criu.dump(
                root.pid, images, leave_running=req.leave_running, log_path=dump_log
            )
        except GpusnapError:
            if follower is not None:
                follower.abort()
            if freeze.cuda_pids:
                _thaw_after_failure(svc, freeze)
            raise
        if not req.leave_running:
            # The tree is gone; from here on cancelling would lose the workload.
            ctx.cancellable = False
        if req.leave_running and freeze.cuda_pids:
            ctx.phase(Phase.THAW)
            t_thaw = time.monotonic()
            svc.gpu.thaw(freeze)
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
        files = [e for path, kind in watched if (e := file_entry(path, kind)) is not None]
        gpu_stamp.update(freeze.to_stamp())
        stamp: dict[str, Any] = {
            "stamp_version": STAMP_VERSION,
            "host": host,
            "gpusnap": gpusnap_stamp(),
            "engine": engine,
            "model": model,
            "files": files,
            "launch": launch,
            "gpu": gpu_stamp,
            "process": {
                "root_pid": root.pid,
                "pids": pids,
                "threads": sum(p.threads for p in tree),
                "comm": Path(root.exe).name if root.exe else "",
            },
        }
        spec: dict[str, Any] = {
            "workload": req.workload,
            "launch": launch,
            "leave_running": req.leave_running,
            "trigger": _trigger_of(svc, ctx),
        }

        ctx.phase(Phase.UPLOAD)
        uploaded = _uploaded_streams(getattr(freeze, "uploaded_streams", None), follower)
        try:
            pushed = store.push(
                images,
                workload=req.workload,
                parent=parent,
                stamp=stamp,
                spec=spec,
                progress=ctx.progress,
                compress=req.compress,
                extra={"job": ctx.job_id, "pause_seconds": round(pause, 6)},
                uploaded_streams=uploaded,
            )
        except GpusnapError as err:
            if not req.leave_running:
                rescued = _rescue(
                    svc, ctx, images, freeze=freeze, gpu_stamp=stamp["gpu"], store=store
                )
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
            "leave_running": req.leave_running,
        }
        if ctx.deadline is not None:
            result["committed_before_deadline"] = committed <= ctx.deadline
        ctx.result(**result)
        svc.checkpoint_committed(req.workload, committed)
        dump_log.unlink(missing_ok=True)
        dump_log.with_name(dump_log.name + ".stdout").unlink(missing_ok=True)
    finally:
        if follower is not None:
            follower.abort()  # a no-op once finished; else it must stop reading staging
        shutil.rmtree(staging, ignore_errors=True)


def _uploaded_streams(
    gpu: UploadedStreams | None, follower: PageImageFollower | None
) -> UploadedStreams | None:
    """What the push names besides the staging files: GPU memory and page images uploaded
    while CRIU wrote them (``finish`` waits for the rest of them to go up)."""
    pages = follower.finish() if follower is not None else None
    if pages is None or not pages.entries:
        return gpu
    if gpu is None:
        return pages
    merged = UploadedStreams()
    merged.merge(gpu)
    merged.merge(pages)
    return merged


def _trigger_of(svc: DaemonService, ctx: JobContext) -> str:
    try:
        return svc.executor.get(ctx.job_id).trigger
    except GpusnapError:
        return "unknown"


def _thaw_after_failure(svc: DaemonService, freeze: Any) -> None:
    try:
        svc.gpu.thaw(freeze)
    except GpusnapError as err:
        log.warning("GPU thaw after a failed dump failed too: %s", err)


def _rescue(
    svc: DaemonService,
    ctx: JobContext,
    images: Path,
    *,
    freeze: Any,
    gpu_stamp: dict[str, Any],
    store: CheckpointStore,
) -> str:
    """A kill-mode dump whose upload failed: bring the workload back from the local images,
    and its CUDA processes back onto their GPUs (CRIU alone leaves them CHECKPOINTED).

    Returns what happened, in words, and never raises: its caller is already reporting the
    upload's failure, and the rescue's own failure must be said in that one line, with what
    (if anything) was lost."""
    try:
        return _rescue_or_raise(svc, ctx, images, freeze=freeze, gpu_stamp=gpu_stamp, store=store)
    except Exception as exc:  # the one line must say it, never a traceback
        log.exception("rescue of job %s failed", ctx.job_id)
        return f"rescuing the workload failed ({type(exc).__name__}: {exc}); see the daemon log"


def _rescue_or_raise(
    svc: DaemonService,
    ctx: JobContext,
    images: Path,
    *,
    freeze: Any,
    gpu_stamp: dict[str, Any],
    store: CheckpointStore,
) -> str:
    if not images.is_dir():
        log.error("job %s: the local images %s are gone; the workload is lost", ctx.job_id, images)
        return (
            f"the workload cannot be restored locally either: its images {images} are gone "
            "(removed by something outside this job); the workload is lost"
        )
    sibling = not systemd_running()
    try:
        restored = svc.criu.restore(
            images,
            log_path=svc.logs_dir / f"{ctx.job_id}-rescue.log",
            pidfile=svc.logs_dir / f"{ctx.job_id}-rescue.pid",
            scope_unit=f"gpusnap-rescue-{ctx.job_id}",
            sibling=sibling,
        )
    except GpusnapError as err:
        kept = _keep_images(svc, ctx, images)
        return f"restoring the workload locally failed too ({err}); {kept}"
    if sibling:
        svc.adopt(restored.pid)
    done = f"the workload was restored on this node from the local dump (pid {restored.pid})"
    if not freeze.cuda_pids:
        return done
    try:
        if getattr(freeze, "uploaded_streams", None) is not None:
            # Custom storage: the device memory is in the store's (uncommitted) streams only;
            # thawing the freeze refills it from there.
            svc.gpu.thaw(freeze)
        else:
            svc.gpu.restore(list(freeze.cuda_pids), gpu_stamp, store=store)
    except GpusnapError as err:
        log.warning("GPU restore after the local rescue of job %s failed: %s", ctx.job_id, err)
        return f"{done}, but its GPU state was not restored ({err})"
    return f"{done} with its GPU state"


def _keep_images(svc: DaemonService, ctx: JobContext, images: Path) -> str:
    """Move the images out of staging (which is removed when the job ends); say where."""
    kept = svc.state_dir / "kept" / ctx.job_id
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(images), str(kept))
    except OSError as exc:
        log.exception("job %s: cannot keep the images %s in %s", ctx.job_id, images, kept)
        if not images.is_dir():
            return f"its images {images} are gone ({exc.strerror or exc}); the workload is lost"
        # The job's staging is removed when it ends, and any job-named entry at the next
        # start: a rename within staging (same file system) keeps them out of both.
        beside = svc.staging_root / f"kept-{ctx.job_id}"
        try:
            os.rename(images, beside)
        except OSError:
            log.exception("job %s: cannot keep the images in %s either", ctx.job_id, beside)
            return (
                f"its images could not be kept ({exc.strerror or exc}) and go with the job's "
                "staging; the workload is lost"
            )
        return f"its images are kept in {beside} ({kept} failed: {exc.strerror or exc})"
    return f"its images are kept in {kept}"


def _watched_files(pids: list[int]) -> list[tuple[str, str]]:
    """(path, kind) of the regular files the tree has open or mapped.

    kind: ``mapped``, ``open-ro`` (read only), ``open-rw`` (written by the process) or
    ``open-append``; the compatibility gate applies a rule per kind (docs/compat.md).
    """
    kinds: dict[str, str] = {}
    rank = {"mapped": 0, "open-ro": 1, "open-append": 2, "open-rw": 3}

    def add(path: str, kind: str) -> None:
        if path.startswith(_PSEUDO_PREFIXES) or path.endswith(" (deleted)"):
            return
        if rank[kind] >= rank.get(kinds.get(path, "mapped"), 0) or path not in kinds:
            kinds[path] = kind

    for pid in pids:
        try:
            for ref in proctree.mapped_files(pid):
                add(ref.path, "mapped")
        except GpusnapError:
            continue
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            fds = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
                flags = _fd_flags(pid, fd.name)
            except OSError:
                continue
            if not target.startswith("/"):
                continue
            acc = flags & os.O_ACCMODE
            if acc == os.O_RDONLY:
                add(target, "open-ro")
            elif flags & os.O_APPEND:
                add(target, "open-append")
            else:
                add(target, "open-rw")
    return sorted(kinds.items())


def _fd_flags(pid: int, fd: str) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


# --- restore -------------------------------------------------------------------------------------


def run_restore(svc: DaemonService, ctx: JobContext, req: RestoreRequest) -> None:
    job_started = ctx.created_at
    # Refused at submission too; checked again here, where the manifest is acted on.
    svc.require_verified("restore")
    store = svc.store.get()
    ctx.phase(Phase.COMPAT)
    checkpoint_id = req.checkpoint_id
    if checkpoint_id is None:
        assert req.workload is not None
        latest = store.latest(req.workload)
        if latest is None:
            raise NotFound(f"workload {req.workload} has no checkpoint in the store")
        checkpoint_id = latest.checkpoint_id
    manifest = store.manifest(checkpoint_id)  # authenticated: Corrupt if altered or unsigned
    if ctx.workload != manifest.workload:
        ctx.set_workload(manifest.workload)
    ctx.result(checkpoint_id=checkpoint_id)

    reasons = svc.reasons(manifest)
    if reasons:
        wcfg = svc.config.workload(manifest.workload)
        spec = (
            coldstart.from_config(wcfg.start)
            if wcfg is not None and wcfg.start is not None
            else coldstart.from_stamp(manifest.stamp.get("launch"))
        )
        ctx.phase(Phase.COLD_START)
        log.warning(
            "checkpoint %s does not fit this node: %s; cold-starting %s",
            checkpoint_id,
            "; ".join(r.message for r in reasons),
            manifest.workload,
        )
        log_path = svc.logs_dir / f"{manifest.workload}-{ctx.job_id}.log"
        proc = coldstart.launch(spec, log_path)
        svc.adopt(proc.pid, proc)
        ctx.result(
            mode="cold-start",
            pids=[proc.pid],
            reasons=[r.message for r in reasons],
            reason_details=[
                {"field": r.field, "expected": r.expected, "actual": r.actual, "message": r.message}
                for r in reasons
            ],
            launch_source=spec.source,
            log=str(log_path),
            seconds=round(time.time() - job_started, 6),
        )
        return

    process = manifest.stamp.get("process") or {}
    pids = [int(p) for p in process.get("pids", []) if isinstance(p, int)]
    for pid in pids:
        if Path(f"/proc/{pid}").exists():
            raise FailedPrecondition(
                f"pid {pid} of the checkpointed tree is in use here by {_comm(pid)!r}; CRIU "
                "restores processes with their original pids: stop (and reap) that process first"
            )

    staging = svc.staging_dir(ctx.job_id)
    images = staging / "images"
    restore_log = svc.logs_dir / f"{ctx.job_id}-restore.log"
    try:
        ctx.phase(Phase.FETCH)
        # Accepted -> the pull starts: the manifest, the compatibility gate, the pid check.
        prepare = time.time() - job_started
        # Staging: CRIU reads these files the moment the pull ends and they are deleted
        # after: through the page cache, and not synced.
        pulled = store.pull(
            checkpoint_id,
            images,
            progress=ctx.progress,
            exclude_kinds=(GPU_MEMORY_KIND,),
            direct=False,
            durable=False,
        )
        ctx.phase(Phase.RESTORE_PROCESS)
        # From here the tree runs (or is being made to): a cancel could only orphan it.
        ctx.cancellable = False
        sibling = not systemd_running()
        restored = svc.criu.restore(
            images,
            log_path=restore_log,
            pidfile=staging / "restore.pid",
            scope_unit=f"gpusnap-{manifest.workload}-{ctx.job_id}",
            sibling=sibling,
            # Punch each page out of the staging images once restored: the restored memory
            # reuses the pages the pull just filled (warm) instead of touching fresh ones,
            # and the node never holds the images and the restored memory at once. Only
            # where the staging filesystem can punch holes (CRIU fails the restore if not).
            extra_args=("--auto-dedup",) if can_punch_holes(staging) else (),
        )
        if sibling:
            for pid in {restored.pid, *pids}:
                svc.adopt(pid)
        ctx.phase(Phase.RESTORE_GPU)
        gpu_stamp = manifest.stamp.get("gpu")
        svc.gpu.restore(
            pids or [restored.pid],
            gpu_stamp if isinstance(gpu_stamp, dict) else {},
            store=store,
            manifest=manifest,
        )
        ctx.result(
            mode="restored",
            pids=[restored.pid, *[p for p in pids if p != restored.pid]],
            reasons=[],
            prepare_seconds=round(prepare, 6),
            fetch_seconds=round(pulled.seconds, 6),
            bytes_fetched=pulled.bytes_fetched,
            bytes_total=pulled.bytes_total,
            restore_seconds=round(restored.wall_seconds, 6),
            # CRIU's own account (--display-stats): its time restoring, pages it wrote.
            criu_restore_time_seconds=round(restored.stats.get("Restore time", 0) / 1e6, 6),
            criu_pages_restored=restored.stats.get("Pages restored", 0),
            seconds=round(time.time() - job_started, 6),
        )
        restore_log.unlink(missing_ok=True)
        restore_log.with_name(restore_log.name + ".stdout").unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
