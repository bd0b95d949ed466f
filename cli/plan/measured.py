"""``gpusnap plan --workload NAME``: a workload's real checkpoints, asked of the node's daemon.

Instead of estimating what a checkpoint of the workload holds, the plan reads it from the
workload's last checkpoints in the store, through the daemon (``Checkpoints.List`` for the
summaries, ``Checkpoints.Show`` for at most three manifests, authenticated by the daemon):

- the latest checkpoint: its logical size (what a full checkpoint of the process is), its GPU
  memory streams (entries of kind ``gpu-memory``), its CRIU page images (``pages-*.img``) and
  the rest of its host files;
- the last incremental one (the newest with a parent): the bytes it uploaded and how long its
  upload took, which is what a reclaim checkpoint after a periodic one costs;
- the last full one (the newest without a parent): the bytes it uploaded.

A workload with no checkpoint is ``NotFound`` (exit 3); no daemon, exit 5.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

from gpusnap.cli._client import DaemonClient, connect
from gpusnap.errors import NotFound
from gpusnap.storage.streams import GPU_MEMORY_KIND, STREAMS_EXTRA_KEY

_PAGE_IMAGE = re.compile(r"(?:.*/)?pages-\d+\.img")


@dataclass(frozen=True)
class Pushed:
    """One checkpoint as its manifest records its push."""

    checkpoint_id: str
    parent: str | None
    created_at: float
    bytes_total: int  # logical bytes of every file of the image
    bytes_uploaded: int  # chunk object bytes this push sent (new chunks, compressed)
    upload_seconds: float | None  # the push, from the store's latest to the manifest
    pause_seconds: float | None  # the process's pause (the dump, and the GPU's freeze)

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> Pushed:
        totals = manifest.get("totals") or {}
        extra = manifest.get("extra") or {}
        return cls(
            checkpoint_id=str(manifest["checkpoint_id"]),
            parent=manifest.get("parent"),
            created_at=float(manifest.get("created_at") or 0.0),
            bytes_total=int(manifest.get("bytes_total") or totals.get("bytes_total") or 0),
            bytes_uploaded=int(totals.get("bytes_stored") or 0),
            upload_seconds=_seconds(totals.get("seconds")),
            pause_seconds=_seconds(extra.get("pause_seconds")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "parent": self.parent,
            "created_at": self.created_at,
            "bytes_total": self.bytes_total,
            "bytes_uploaded": self.bytes_uploaded,
            "upload_seconds": self.upload_seconds,
            "pause_seconds": self.pause_seconds,
        }


@dataclass(frozen=True)
class Measured:
    """What the workload's last checkpoints say, per node."""

    workload: str
    checkpoints: int  # how many the store holds of it
    latest: Pushed
    gpu_memory_streams: list[tuple[str, int]] = field(default_factory=list)  # (path, bytes)
    page_image_bytes: int = 0
    other_host_bytes: int = 0
    last_incremental: Pushed | None = None
    last_full: Pushed | None = None

    @property
    def gpu_memory_bytes(self) -> int:
        return sum(size for _path, size in self.gpu_memory_streams)

    @property
    def reclaim_bytes(self) -> int | None:
        """What a reclaim checkpoint after a periodic one uploads: the last incremental's."""
        return None if self.last_incremental is None else self.last_incremental.bytes_uploaded

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "checkpoints": self.checkpoints,
            "latest": self.latest.to_json(),
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "gpu_memory_streams": [{"path": p, "bytes": n} for p, n in self.gpu_memory_streams],
            "page_image_bytes": self.page_image_bytes,
            "other_host_bytes": self.other_host_bytes,
            "last_incremental": self.last_incremental.to_json() if self.last_incremental else None,
            "last_full": self.last_full.to_json() if self.last_full else None,
        }


def from_daemon(args: argparse.Namespace, workload: str) -> Measured:
    """The workload's last checkpoints, through the daemon at ``--socket``/``--address``."""
    with connect(args) as client:
        return measure(client, workload)


def measure(client: DaemonClient, workload: str) -> Measured:
    summaries = client.list_checkpoints(workload)  # newest first
    if not summaries:
        raise NotFound(f"workload {workload} has no checkpoint in the store")
    shown: dict[str, dict[str, Any]] = {}

    def show(checkpoint_id: str) -> dict[str, Any]:
        if checkpoint_id not in shown:
            shown[checkpoint_id] = client.show_checkpoint(checkpoint_id)
        return shown[checkpoint_id]

    def pushed(summary: dict[str, Any] | None) -> Pushed | None:
        return None if summary is None else Pushed.of(show(str(summary["checkpoint_id"])))

    latest = show(str(summaries[0]["checkpoint_id"]))
    streams, pages, other = _split(latest)
    return Measured(
        workload=workload,
        checkpoints=len(summaries),
        latest=Pushed.of(latest),
        gpu_memory_streams=streams,
        page_image_bytes=pages,
        other_host_bytes=other,
        last_incremental=pushed(next((s for s in summaries if s.get("parent")), None)),
        last_full=pushed(next((s for s in summaries if not s.get("parent")), None)),
    )


def _split(manifest: dict[str, Any]) -> tuple[list[tuple[str, int]], int, int]:
    """(GPU memory streams, page image bytes, other host bytes) of a manifest's files."""
    raw = (manifest.get("extra") or {}).get(STREAMS_EXTRA_KEY) or {}
    kinds = {p: str(v.get("kind")) for p, v in raw.items() if isinstance(v, dict)}
    streams: list[tuple[str, int]] = []
    pages = other = 0
    for entry in manifest.get("files") or []:
        path, size = str(entry["path"]), int(entry["size"])
        if kinds.get(path) == GPU_MEMORY_KIND:
            streams.append((path, size))
        elif _PAGE_IMAGE.fullmatch(path):
            pages += size
        else:
            other += size
    return sorted(streams), pages, other


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
