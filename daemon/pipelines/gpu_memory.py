"""GPU device memory in the store: the sink and source that custom storage copies through.

The GPU layer copies device memory itself where the driver offers custom storage
(``daemon/gpu/custom_storage.py``), but never sees the store: the checkpoint body hands a
freeze a ``MemoryUploads``' sink and source, the restore body hands a restore
``committed_source``. Each process's memory becomes stream entries of kind ``gpu-memory``
(``gpusnap.storage.streams``) that the checkpoint's manifest names.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence

from gpusnap.daemon.gpu.custom_storage import CustomStorage, DeviceMemory, MemorySource, Piece
from gpusnap.errors import FailedPrecondition
from gpusnap.storage import CheckpointStore, Manifest
from gpusnap.storage.pull import PullStats
from gpusnap.storage.streams import GPU_MEMORY_KIND, StreamSource, UploadedStreams


class MemoryUploads:
    """One checkpoint's device memory, uploaded ahead of its manifest.

    ``sink`` puts each process's memory in the store (``CheckpointStore.upload_streams``)
    before the driver may drop it; ``uploaded`` is what the checkpoint's push names. ``source``
    reads it back for a thaw (leave-running), a roll-back or a rescue: before the commit only
    these streams hold that memory. ``full`` puts every chunk, whatever the index says (a full
    push); ``seed_cache`` keeps what goes up in the node's chunk cache too (``[cache] seed``).
    """

    def __init__(
        self, store: CheckpointStore, *, full: bool = False, seed_cache: bool = False
    ) -> None:
        self._store = store
        self._full = full
        self._seed_cache = seed_cache
        self.uploaded: UploadedStreams | None = None

    def custom_storage(self) -> CustomStorage:
        return CustomStorage(sink=self.sink, source=self.source)

    def sink(self, memory: Sequence[DeviceMemory]) -> None:
        streams = {m.path: StreamSource(m.size, m.buffers, GPU_MEMORY_KIND) for m in memory}
        uploaded = self._store.upload_streams(streams, full=self._full, seed_cache=self._seed_cache)
        if self.uploaded is None:
            self.uploaded = uploaded
        else:
            self.uploaded.merge(uploaded)

    def source(self, path: str) -> Iterable[tuple[int, Piece]]:
        if self.uploaded is None:
            raise FailedPrecondition("the frozen GPU memory is in no store; cannot thaw")
        # The store reads an entry through a manifest; these entries have none yet, so they
        # are read through one that lists them and is never written anywhere.
        pending = Manifest(
            checkpoint_id="(not yet committed)",
            workload="gpu-freeze",
            created_at=time.time(),
            parent=None,
            stamp={},
            spec={},
            files=list(self.uploaded.entries),
            totals={},
            extra={},
        )
        return self._store.open_stream(pending, path)


def committed_source(
    store: CheckpointStore, manifest: Manifest, stats: PullStats | None = None
) -> MemorySource:
    """The device memory a committed (authenticated) checkpoint holds; ``stats`` counts what
    came from the store and from the node's chunk cache."""
    return functools.partial(store.open_stream, manifest, stats=stats)
