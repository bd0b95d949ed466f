"""The body of a container checkpoint job, and which container a request names.

Look at the container -> GPU freeze of its CUDA processes by their host pids -> the runtime's
own checkpoint into staging, as parts (``daemon/containers/``) -> (leave-running: GPU thaw; the
pause ends here) -> stamp (``gate/container_stamp.py``) -> push the parts directory to the store,
each file chunked, so a second checkpoint uploads only what changed and the image is never
uploaded (the stamp pins its digest) -> clean staging. As for a process tree
(``checkpoint.py``), the store is asked for the parent first, a kill-mode checkpoint whose
upload fails restores the container on this node from the local parts, and a container whose
latest checkpoint the store check found damaged gets a full push (``full_push_reason``).
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gpusnap.daemon.config.file import Config, WorkloadConfig
from gpusnap.daemon.containers import (
    Arrivals,
    CheckpointParts,
    ContainerInfo,
    ContainerRuntime,
    Mount,
    RuntimeSet,
    load_parts,
)
from gpusnap.daemon.gate.container_stamp import container_stamp, remap_gpu_stamp
from gpusnap.daemon.gate.stamp import checkpoint_stamp, file_entry, identity_stamp
from gpusnap.daemon.gpu.adapter import Freeze
from gpusnap.daemon.host import preflight, proctree
from gpusnap.daemon.host.files import watched_files
from gpusnap.daemon.host.owners import tree_uids
from gpusnap.daemon.jobs.executor import JobContext
from gpusnap.daemon.jobs.job import Phase
from gpusnap.daemon.node.node import Node
from gpusnap.daemon.node.storecheck import StoreChecker
from gpusnap.daemon.pipelines.checkpoint import (
    after_dump,
    freeze_gpu,
    full_push_reason,
    record_commit,
    thawed_on_failure,
    upload_during_dump,
)
from gpusnap.daemon.pipelines.container_upload import PartsStreamer, merged
from gpusnap.daemon.pipelines.gpu_memory import MemoryUploads
from gpusnap.errors import FailedPrecondition, GpusnapError, InvalidArgument, with_message
from gpusnap.storage.manifest import check_workload

log = logging.getLogger(__name__)

FRESH_S = 1.0
# What podman, runc and containerd accept as a container name.
_CONTAINER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_container_name(name: str) -> str:
    """``name`` when it can name a container (``InvalidArgument`` otherwise)."""
    if not _CONTAINER_NAME.fullmatch(name):
        raise InvalidArgument(
            f"not a container name: {name!r} (letters, digits, '.', '_', '-'; at most 128)"
        )
    return name


@dataclass(frozen=True)
class ContainerCheckpointPlan:
    """What the service decided a container checkpoint takes: the container (``info``, as the
    service saw it: its runtime, its id), the workload it is stored as, and how."""

    info: ContainerInfo
    workload: str
    config: WorkloadConfig | None
    leave_running: bool
    compress: bool | None = None
    # The store check: whether this workload's latest checkpoint is damaged (a full push).
    store_check: StoreChecker | None = None
    # When the service looked at the container (time.monotonic(); the plan is made right
    # after): a job that starts within FRESH_S of it uses ``info`` instead of asking the
    # runtime again (one call less of the trigger-to-commit time); a job that waited in the
    # queue looks again.
    inspected_at: float = field(default_factory=time.monotonic)

    def fresh_info(self) -> ContainerInfo | None:
        if time.monotonic() - self.inspected_at < FRESH_S:
            return self.info
        return None


def container_plan(
    runtimes: RuntimeSet,
    config: Config,
    *,
    ref: str,
    runtime: str | None,
    workload: WorkloadConfig | None,
    leave_running: bool,
    compress: bool | None,
    store_check: StoreChecker | None = None,
) -> ContainerCheckpointPlan:
    """The plan for checkpointing container ``ref`` (its runtime given, or found): it must
    exist and run. Stored as ``workload`` when given, else as the configured workload that
    names this container, else under the container's name."""
    if not ref:
        raise InvalidArgument("give the container's name or id")
    rt, info = runtimes.find(ref, runtime)
    if not info.running:
        raise FailedPrecondition(f"{rt.name}: container {info.name!r} is not running")
    if workload is None:
        workload = next(
            (w for w in config.workloads if w.container in (ref, info.name, info.id)), None
        )
    name = workload.name if workload is not None else info.name
    check_workload(name)
    return ContainerCheckpointPlan(
        info,
        workload=name,
        config=workload,
        leave_running=leave_running,
        compress=compress,
        store_check=store_check,
    )


def run_container_checkpoint(node: Node, ctx: JobContext, plan: ContainerCheckpointPlan) -> None:
    job_started = ctx.created_at
    store = node.store.get()
    # Ask the store first: an unreachable store fails here, before the container is touched.
    latest = store.latest(plan.workload)
    parent = latest.checkpoint_id if latest is not None else None
    full = full_push_reason(plan.store_check, plan.workload, ctx)

    rt = node.containers.get(plan.info.runtime)
    info = plan.fresh_info() or rt.inspect(plan.info.id)
    if not info.running:
        raise FailedPrecondition(f"{rt.name}: container {info.name!r} is not running")
    pids = list(info.pids)
    tree = proctree.process_tree(pids[0])
    uids = tree_uids(p for pid in pids for p in proctree.tree_pids(pid))
    # The runtime dumps the container's mounts (its /dev/shm too): no tmpfs notes.
    preflight.require(node.criu, [p.pid for p in tree], tmpfs=False)
    ns = proctree.ns_pids(pids)
    watched = _host_files(watched_files(pids), info.spec.mounts)
    engine, model = identity_stamp(plan.config, None)
    host = node.host.get()
    gpu_stamp = dict(node.gpu.stamp())

    staging = node.dirs.job_staging(ctx.job_id)
    dest = staging / "container"
    seed = node.config.cache.seed  # what this node pushes, its chunk cache holds
    # One that uploads everything overlaps that with the runtime's export.
    arrivals = Arrivals() if upload_during_dump(node, parent, full) else None
    streamer = (
        PartsStreamer(
            store, dest, arrivals, compress=plan.compress, full=full is not None, seed_cache=seed
        )
        if arrivals is not None
        else None
    )
    try:
        freeze, gpu_pause, gpu_memory = freeze_gpu(node, ctx, store, pids, full=full is not None)

        ctx.phase(Phase.DUMP)
        prepare = time.time() - job_started
        if streamer is not None:
            streamer.start()
        with thawed_on_failure(node, freeze, streamer):
            parts = rt.checkpoint(
                info.id, dest, leave_running=plan.leave_running, info=info, arrivals=arrivals
            )
        gpu_pause += after_dump(node, ctx, freeze, leave_running=plan.leave_running)
        pause = parts.pause_seconds() + gpu_pause
        summary = info.summary()
        sizes = parts.sizes()
        ctx.result(
            pause_seconds=round(pause, 6),
            dump_seconds=round(parts.seconds, 6),
            prepare_seconds=round(prepare, 6),
            images_bytes=sum(sizes.values()),
            parts_bytes=sizes,
            pids=pids,
            container=summary,
        )

        # Stat'ed after the checkpoint, as for a process tree (the files rule of the gate).
        files = [e for path, kind in watched if (e := file_entry(path, kind)) is not None]
        gpu_stamp.update(freeze.to_stamp())
        stamp = checkpoint_stamp(
            host=host,
            engine=engine,
            model=model,
            files=files,
            launch={"container": summary},
            gpu=gpu_stamp,
            tree=tree,
            uids=uids,
        )
        stamp["container"] = container_stamp(info, parts, ns)
        spec: dict[str, Any] = {
            "workload": plan.workload,
            "container": summary,
            "leave_running": plan.leave_running,
            "trigger": ctx.trigger,
        }

        ctx.phase(Phase.UPLOAD)
        try:
            pushed = store.push(
                dest,
                workload=plan.workload,
                parent=parent,
                stamp=stamp,
                spec=spec,
                progress=ctx.progress,
                compress=plan.compress,
                extra={"job": ctx.job_id, "pause_seconds": round(pause, 6), "container": summary},
                uploaded_streams=merged(
                    gpu_memory.uploaded, streamer.finish() if streamer is not None else None
                ),
                full=full is not None,
                seed_cache=seed,
                deadline=ctx.deadline,
            )
        except GpusnapError as err:
            if not plan.leave_running:
                rescued = _rescue(
                    node,
                    ctx.job_id,
                    rt=rt,
                    parts=parts,
                    freeze=freeze,
                    stamp=stamp,
                    gpu_memory=gpu_memory,
                )
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
    finally:
        if streamer is not None:
            streamer.abort()  # a no-op once finished; else it must stop reading staging
        shutil.rmtree(staging, ignore_errors=True)


def _host_files(
    watched: Sequence[tuple[str, str]], mounts: Sequence[Mount]
) -> list[tuple[str, str]]:
    """The container's open and mapped files that live outside it, by their host paths.

    ``/proc`` shows a container's files by their paths inside it. Those in its image or its rw
    layer travel with the image digest and the rootfs diff; those on a bind mount are the host's
    files, which a restore needs unchanged, as for a process tree (the gate's files rule)."""
    binds = sorted(
        (m for m in mounts if m.type == "bind" and m.source.startswith("/")),
        key=lambda m: -len(m.destination),
    )
    out: list[tuple[str, str]] = []
    for path, kind in watched:
        p = PurePosixPath(path)
        for m in binds:
            dest = PurePosixPath(m.destination)
            if p == dest or dest in p.parents:
                out.append((str(PurePosixPath(m.source) / p.relative_to(dest)), kind))
                break
    return out


def _rescue(
    node: Node,
    job_id: str,
    *,
    rt: ContainerRuntime,
    parts: CheckpointParts,
    freeze: Freeze,
    stamp: Mapping[str, Any],
    gpu_memory: MemoryUploads,
) -> str:
    """A kill-mode checkpoint whose upload failed: the container back from its local parts,
    its GPU state too. What happened, in words; never raises."""
    try:
        before = {p: n for p, n in (stamp["container"].get("ns_pids") or [])}
        restored: ContainerInfo = rt.restore(load_parts(parts.directory))
    except Exception as exc:  # the job's one line must say it, never a traceback
        log.exception("job %s: restoring the container from its local parts failed", job_id)
        return f"restoring the container locally failed too ({exc}); {_keep(node, job_id, parts)}"
    done = f"the container was restored on this node from the local checkpoint ({restored.name})"
    if not freeze.cuda_pids:
        return done
    try:
        gpu = remap_gpu_stamp(stamp["gpu"], before, proctree.ns_pids(restored.pids))
        source = gpu_memory.source if gpu_memory.uploaded is not None else None
        node.gpu.restore(list(restored.pids), gpu, source=source)
    except GpusnapError as err:
        log.warning("job %s: GPU restore after the local rescue failed: %s", job_id, err)
        return f"{done}, but its GPU state was not restored ({err})"
    return f"{done} with its GPU state"


def _keep(node: Node, job_id: str, parts: CheckpointParts) -> str:
    kept: Path = node.dirs.kept(job_id)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(parts.directory), str(kept))
    except OSError as exc:
        log.exception("job %s: cannot keep the parts %s", job_id, parts.directory)
        return f"its parts could not be kept ({exc.strerror or exc}); the container is lost"
    return f"its parts are kept in {kept}"
