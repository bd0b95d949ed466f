"""Uploading CRIU's page images while CRIU is still writing them.

A checkpoint's time to commit would otherwise be the dump *then* the upload: CRIU writes
every page into staging, and only then does the store read, cut, hash, compress and upload
them. CRIU writes a page image (``pages-<n>.img``) front to back, one process's at a time,
so the store can read the file as it grows: ``PageStreamer`` hands each page image, as it
appears, to the store, which cuts and uploads it while it grows (``storage/growing.py``), on a
thread of its own, while CRIU dumps. When CRIU exits the streamer reads what is left and the
push names the uploaded streams instead of reading the files again
(``UploadedStreams.of_files``).

A page image is taken as complete when CRIU has exited, or when the next page image exists
(CRIU has moved on to the next process) and the end of the file has been reached. The push
checks each file's size against what was streamed and reads any file that differs again,
so a streamer that was wrong costs time, never a wrong checkpoint. The streamer runs at
the lowest CPU priority while CRIU runs: on a busy node the dump (the workload's pause)
comes first.

Used when the checkpoint uploads everything: it has no parent, or it is a full one (the store
check found its parent damaged; ``full`` then puts every chunk, as the push does). An upload
after a parent is cheap otherwise (``storage/follow.py`` follows the parent's chunks).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gpusnap.storage.streams import UploadedStreams

log = logging.getLogger(__name__)

_PAGES = re.compile(r"pages-(\d+)\.img")
_POLL = 0.003  # seconds between looks at a file that has not grown
_KIND = "criu-pages"


class _Uploader(Protocol):
    """What the streamer needs of the store (``CheckpointStore.upload_growing``)."""

    def upload_growing(
        self,
        path: Path,
        name: str,
        *,
        complete: Callable[[], bool],
        stop: Callable[[], bool] = ...,
        kind: str = ...,
        compress: bool | None = ...,
        full: bool = ...,
        seed_cache: bool = ...,
    ) -> UploadedStreams: ...


def _page_images(images: Path) -> list[str]:
    """The page images in ``images`` now, in the order CRIU creates them."""
    try:
        names = [m for name in os.listdir(images) if (m := _PAGES.fullmatch(name))]
    except FileNotFoundError:
        return []
    return [m.group(0) for m in sorted(names, key=lambda m: int(m.group(1)))]


class PageStreamer:
    """Streams ``images/pages-*.img`` into the store while CRIU writes them."""

    def __init__(
        self,
        store: _Uploader,
        images: Path,
        *,
        compress: bool | None,
        full: bool = False,
        seed_cache: bool = False,
    ) -> None:
        self._store = store
        self._images = images
        self._compress = compress
        self._full = full  # a full push: every chunk put, whatever the index says
        self._seed_cache = seed_cache  # keep what goes up in the node's chunk cache too
        self._dumped = threading.Event()  # CRIU has exited (or failed)
        self._abort = threading.Event()
        self._result = UploadedStreams()
        self._error: BaseException | None = None
        self._tids: list[int] = []
        self._thread = threading.Thread(target=self._run, name="gpusnap-pagestream", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> UploadedStreams | None:
        """CRIU is done: upload what is left; the streams, or None if streaming failed."""
        self._dumped.set()
        self._renice(0)
        if self._thread.ident is not None:  # started
            self._thread.join()
        if self._error is not None:
            log.warning("uploading page images during the dump failed: %s", self._error)
            return None
        return self._result

    def bytes_streamed(self) -> int:
        """Bytes of the page images already in the store (each counted once uploaded whole)."""
        return self._result.bytes_total

    def abort(self) -> None:
        """CRIU failed: stop (chunks already uploaded are left to gc)."""
        self._abort.set()
        self._dumped.set()
        if self._thread.ident is not None:  # started
            self._thread.join()

    # --- the streamer thread -------------------------------------------------------------

    def _renice(self, value: int) -> None:
        for tid in list(self._tids):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, value)

    def _run(self) -> None:
        self._tids.append(threading.get_native_id())
        if not self._dumped.is_set():
            self._renice(19)
            if self._dumped.is_set():  # finish() ran in between: back to normal priority
                self._renice(0)
        try:
            done: set[str] = set()
            while not self._abort.is_set():
                todo = [name for name in _page_images(self._images) if name not in done]
                if not todo:
                    if self._dumped.is_set():
                        return
                    time.sleep(_POLL)
                    continue
                name = todo[0]
                uploaded = self._store.upload_growing(
                    self._images / name,
                    name,
                    complete=functools.partial(self._complete, name),
                    stop=self._abort.is_set,
                    kind=_KIND,
                    compress=self._compress,
                    full=self._full,
                    seed_cache=self._seed_cache,
                )
                self._result.merge(uploaded)
                done.add(name)
        except Exception as exc:  # reported by finish(); the push then reads the files
            self._error = exc

    def _complete(self, name: str) -> bool:
        """CRIU is done, or has started the next page image (so is done with this one)."""
        if self._dumped.is_set():
            return True
        later = _page_images(self._images)
        return bool(later) and later[-1] != name
