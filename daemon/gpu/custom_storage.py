"""Custom storage: device memory copied by the daemon itself, between the GPU and a sink/source.

With a driver that offers custom storage (CUDA 13.4 API), ``cuCheckpointProcessCheckpoint``
maps the target's device memory into the GPU worker instead of staging it in the target's
host memory. The worker copies it, a batch of ranges at a time, into one half of a shared
ring of pinned host buffers (``ring.HostRing``) on several streams, while the daemon hands the
other half to a ``MemorySink``. A restore runs the same ring the other way: pieces read from a
``MemorySource`` fill one half while the worker copies the other into the mapped memory. Every
worker call has the worker's deadline.

Where the bytes go is not this package's business: the checkpoint and restore bodies build the
sink and the source from the store (``daemon/pipelines/gpu_memory.py``), so the GPU layer never
imports the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gpusnap.daemon.gpu.ring import HostRing
from gpusnap.daemon.gpu.worker import GpuWorker, PendingCall
from gpusnap.errors import Corrupt, FailedPrecondition, GpusnapError

log = logging.getLogger(__name__)

Copy = list[int]  # [ring offset, device offset, bytes]
Piece = bytes | memoryview


@dataclass(frozen=True)
class DeviceMemory:
    """One process's mapped memory on one GPU, as the copy yields it: ``size`` bytes, given in
    order by ``buffers``; each buffer is valid only until the next is asked for."""

    path: str  # its entry among the checkpoint's files (``memory_path``)
    size: int
    buffers: Iterable[memoryview]


# Takes every device's memory of one process and returns only once all of it is stored (the
# driver may drop it then); raises a ``GpusnapError`` when it cannot, and the copy is abandoned.
MemorySink = Callable[[Sequence[DeviceMemory]], None]
# The stored bytes of one entry (a ``DeviceMemory.path``), as ``(offset, bytes)`` in order.
MemorySource = Callable[[str], Iterable[tuple[int, Piece]]]


@dataclass(frozen=True)
class CustomStorage:
    """Where a freeze's device memory goes (``sink``) and where a thaw or a roll-back of that
    freeze finds it again (``source``: the driver keeps no copy of its own)."""

    sink: MemorySink
    source: MemorySource


def memory_path(pid: int, position: int, uuid: str) -> str:
    """Where device ``position`` of process ``pid`` lives among the checkpoint's entries."""
    return f"gpu-memory/{pid}/{position}-{uuid}.bin"


def _batches(ring: HostRing, size: int) -> list[list[Copy]]:
    """The device's ranges, slot by slot, grouped by ring half (batch b uses half b % 2)."""
    batches: list[list[Copy]] = []
    offset = 0
    while offset < size:
        half = len(batches) % 2
        batch: list[Copy] = []
        for slot in range(half * ring.half, (half + 1) * ring.half):
            if offset >= size:
                break
            n = min(ring.slot_bytes, size - offset)
            batch.append([ring.offset(slot), offset, n])
            offset += n
        batches.append(batch)
    return batches


def _settle(pending: PendingCall | None) -> None:
    """Wait for a call left in flight when a stream stops early; its error is not the news."""
    if pending is None:
        return
    try:
        pending.result()
    except Exception as exc:
        log.info("GPU copy left in flight ended with: %s", exc)


def read_device(
    worker: GpuWorker, ring: HostRing, handle: int, device: int, size: int
) -> Iterator[memoryview]:
    """The mapped memory of ``device`` (an index into the operation's devices), in order.

    Each view is valid until the next is asked for (``StreamSource`` semantics); the next
    batch is already being copied into the other half of the ring meanwhile.
    """
    batches = _batches(ring, size)
    pending: PendingCall | None = None
    try:
        if batches:
            pending = worker.begin("copy_out", handle, device, ring.name, batches[0])
        for i, batch in enumerate(batches):
            assert pending is not None
            current, pending = pending, None
            current.result()
            if i + 1 < len(batches):
                pending = worker.begin("copy_out", handle, device, ring.name, batches[i + 1])
            for ring_offset, _device_offset, n in batch:
                view = ring.view(ring_offset, n)
                try:
                    yield view
                finally:
                    view.release()
    finally:
        _settle(pending)


def fill_device(
    worker: GpuWorker,
    ring: HostRing,
    *,
    handle: int,
    device: int,
    size: int,
    chunks: Iterable[tuple[int, Piece]],
) -> None:
    """Fill the mapped memory of ``device`` from ``(offset, bytes)`` pieces given in order."""
    pending: PendingCall | None = None
    half = 0
    batch: list[Copy] = []
    slot_fill = 0  # bytes in the batch's last slot
    expected = 0

    def flush() -> None:
        nonlocal pending, half, batch, slot_fill
        if not batch:
            return
        previous, pending = pending, None
        if previous is not None:
            previous.result()
        pending = worker.begin("copy_in", handle, device, ring.name, batch)
        half ^= 1
        batch, slot_fill = [], 0

    try:
        for offset, data in chunks:
            if offset != expected or offset + len(data) > size:
                raise Corrupt(
                    f"device memory entry gives bytes at {offset}, expected {expected} of {size}"
                )
            expected += len(data)
            view = memoryview(data).cast("B")
            try:
                pos = 0
                while pos < len(view):
                    if not batch or slot_fill == ring.slot_bytes:
                        if len(batch) == ring.half:
                            flush()
                        # This slot is free: the call that last used this half has returned.
                        slot = half * ring.half + len(batch)
                        batch.append([ring.offset(slot), offset + pos, 0])
                        slot_fill = 0
                    n = min(ring.slot_bytes - slot_fill, len(view) - pos)
                    target = ring.view(batch[-1][0] + slot_fill, n)
                    try:
                        target[:] = view[pos : pos + n]
                    finally:
                        target.release()
                    batch[-1][2] += n
                    slot_fill += n
                    pos += n
            finally:
                view.release()
        if expected != size:
            raise Corrupt(f"device memory entry holds {expected} bytes, the GPU mapping {size}")
        flush()
        last, pending = pending, None
        if last is not None:
            last.result()
    finally:
        _settle(pending)


def describe(info: dict[str, Any]) -> str:
    return ", ".join(f"{d.get('uuid')}: {d.get('size')} bytes" for d in info.get("devices", []))


def checkpoint_process(
    worker: GpuWorker, ring: HostRing, pid: int, sink: MemorySink
) -> list[dict[str, Any]]:
    """Map ``pid``'s device memory, copy it into ``sink``, complete; its ``memory_files``."""
    worker.call("ring_attach", ring.name, ring.size)
    info = dict(worker.call("checkpoint_custom_storage", pid))
    handle = int(info["handle"])
    log.info("copying GPU memory of process %d (%s)", pid, describe(info))
    memory: list[DeviceMemory] = []
    files: list[dict[str, Any]] = []
    for position, dev in enumerate(info["devices"]):
        size = int(dev["size"])
        path = memory_path(pid, position, str(dev["uuid"]))
        memory.append(DeviceMemory(path, size, read_device(worker, ring, handle, position, size)))
        files.append(
            {"pid": pid, "position": position, "uuid": dev["uuid"], "path": path, "size": size}
        )
    try:
        sink(memory)
    except GpusnapError:
        # Completing now would let the driver drop memory that is not safely stored: kill the
        # worker instead, which drops its mappings (the driver is assumed to abandon the
        # operation; unverified on hardware).
        worker.kill()
        raise
    worker.call("operation_complete", handle)
    return files


def restore_process(
    worker: GpuWorker,
    ring: HostRing,
    pid: int,
    *,
    files: dict[tuple[int, str], dict[str, Any]],
    pairs: list[list[str]] | None,
    source: MemorySource,
) -> None:
    """Restore ``pid`` with its memory mapped here, fill each device from ``source``, complete.

    ``files``: the checkpoint's ``memory_files`` by (pid, this node's GPU UUID).
    """
    info = dict(worker.call("restore_custom_storage", pid, pairs))
    handle = int(info["handle"])
    try:
        for position, dev in enumerate(info["devices"]):
            found = files.get((pid, str(dev["uuid"])))
            if found is None:
                raise FailedPrecondition(
                    f"the checkpoint holds no GPU memory of process {pid} for GPU {dev['uuid']}"
                )
            if int(found["size"]) != int(dev["size"]):
                raise FailedPrecondition(
                    f"GPU {dev['uuid']} maps {dev['size']} bytes for process {pid}, the "
                    f"checkpoint holds {found['size']}"
                )
            fill_device(
                worker,
                ring,
                handle=handle,
                device=position,
                size=int(dev["size"]),
                chunks=source(str(found["path"])),
            )
    except GpusnapError:
        # Never complete a restore whose memory is not all there: drop the mappings (the
        # driver is assumed to abandon the operation; unverified on hardware).
        worker.kill()
        raise
    worker.call("operation_complete", handle)
