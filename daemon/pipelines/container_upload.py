"""Uploading a container checkpoint's parts while the runtime is still exporting them.

A container's checkpoint would otherwise commit after the runtime's whole export *then* the
whole upload. podman and containerd export an archive that ``containers.archive.TarReceiver``
unpacks into staging file by file, and says so (``Arrivals``); ``PartsStreamer`` follows it
and hands each large file, as it arrives, to the store, which cuts and uploads it while it is
written (``CheckpointStore.upload_growing``), on a thread of its own. When the runtime returns
the streamer uploads what is left and the push names the uploaded streams instead of reading
the files again; a file whose size differs from what was streamed is read again by the push
(``storage/push.py``), so a streamer that was wrong costs time, never a wrong checkpoint.

Used for a checkpoint that uploads everything, a workload's first (no parent) or a full one
(``full``: every chunk put, as the push does), like ``host/pagestream.py`` for a process tree:
a later one follows its parent's chunks, which makes its upload cheap after the export.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

from gpusnap.daemon.containers import Arrivals
from gpusnap.storage import CheckpointStore
from gpusnap.storage.streams import UploadedStreams

log = logging.getLogger(__name__)

KIND = "container-part"
MIN_BYTES = 1 << 20  # smaller files are read by the push: cheaper than following them
_POLL = 0.003


class PartsStreamer:
    """Streams the large files of ``directory`` into the store as ``arrivals`` announces them."""

    def __init__(
        self,
        store: CheckpointStore,
        directory: Path,
        arrivals: Arrivals,
        *,
        compress: bool | None,
        full: bool = False,
        seed_cache: bool = False,
    ) -> None:
        self._store = store
        self._full = full
        self._seed_cache = seed_cache
        self._dir = directory
        self._arrivals = arrivals
        self._compress = compress
        self._abort = threading.Event()
        self._result = UploadedStreams()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gpusnap-partstream", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> UploadedStreams | None:
        """The runtime is done: upload what is left; the streams, or None if streaming failed
        (the push then reads every file)."""
        self._arrivals.done.set()
        self._thread.join()
        if self._error is not None:
            log.warning("uploading container parts during the export failed: %s", self._error)
            return None
        return self._result

    def abort(self) -> None:
        """The runtime failed: stop (chunks already uploaded are left to gc)."""
        self._abort.set()
        self._arrivals.done.set()
        if self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            done = 0
            while not self._abort.is_set():
                files = self._arrivals.files()
                if done == len(files):
                    if self._arrivals.done.is_set():
                        return
                    time.sleep(_POLL)
                    continue
                rel, size = files[done]
                done += 1
                path = self._dir / rel
                if size < MIN_BYTES or not self._wait_for(path, rel):
                    continue
                uploaded = self._store.upload_growing(
                    path,
                    rel,
                    complete=functools.partial(self._arrivals.complete, rel),
                    stop=self._abort.is_set,
                    kind=KIND,
                    compress=self._compress,
                    full=self._full,
                    seed_cache=self._seed_cache,
                )
                self._result.merge(uploaded)
        except Exception as exc:  # reported by finish(); the push then reads the files
            self._error = exc

    def _wait_for(self, path: Path, rel: str) -> bool:
        """Whether ``path`` exists (the receiver announces a file just before creating it)."""
        while not path.exists():
            if self._abort.is_set() or self._arrivals.complete(rel):
                return path.exists()
            time.sleep(_POLL)
        return True


def merged(*parts: UploadedStreams | None) -> UploadedStreams | None:
    """The streams of ``parts`` together (None when there are none)."""
    present = [p for p in parts if p is not None and p.entries]
    if len(present) < 2:
        return present[0] if present else None
    out = UploadedStreams()
    for p in present:
        out.merge(p)
    return out
