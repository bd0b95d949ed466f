"""Length-prefixed JSON frames between the daemon and its GPU worker process."""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any

_HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024

# The calls a driver module offers; the worker runs nothing else.
CALLS = frozenset(
    {
        "init",
        "bindings",
        "driver_version",
        "driver_version_string",
        "devices",
        "memory_info",
        "get_state",
        "get_restore_thread_id",
        "lock",
        "checkpoint",
        "restore",
        "unlock",
        "custom_storage_supported",
        "checkpoint_custom_storage",
        "restore_custom_storage",
        "operation_complete",
        "ring_attach",
        "ring_detach",
        "copy_out",
        "copy_in",
    }
)


class FrameTimeout(Exception):
    """No complete frame arrived before the deadline."""


class PeerClosed(Exception):
    """The other end closed the pipe."""


def write_frame(fd: int, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    data = _HEADER.pack(len(body)) + body
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FrameTimeout
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise FrameTimeout
        chunk = os.read(fd, remaining)
        if not chunk:
            raise PeerClosed
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None) -> dict[str, Any]:
    """One frame; ``deadline`` is a ``time.monotonic()`` value, None waits for ever."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    message = json.loads(_read_exact(fd, size, deadline))
    if not isinstance(message, dict):
        raise TypeError("frame is not a JSON object")
    return message
