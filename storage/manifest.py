"""The manifest: what a checkpoint is. Schema, validation, (de)serialisation.

A checkpoint exists if and only if its manifest exists. The manifest lists every file of the
checkpoint image (relative path, size, permission bits, chunk list), the stamp the daemon
took, the workload's launch spec and totals. It is stored as canonical JSON inside a signed
(and, with an encryption key, encrypted) envelope; see ``keys.seal``.

Everything read from a manifest is validated here before anyone uses it: ids become store
keys and paths become file names, so a malformed one is ``Corrupt``, never a crash or a
write outside the destination.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Any

from gpusnap.errors import Corrupt, InvalidArgument
from gpusnap.storage.untrusted import load_json

SCHEMA_VERSION = 1
ENVELOPE_FORMAT = "gpusnap.manifest/1"

# Always used with ``fullmatch``: ``$`` would also match before a trailing newline.
_CHECKPOINT_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{10}")
_WORKLOAD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CHUNK_ID = re.compile(r"[0-9a-f]{64}")
MAX_PATH_BYTES = 4096


def new_checkpoint_id(now: float | None = None) -> str:
    """A new id, sortable by creation time: ``20261130T083000Z-<10 hex>``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(5)}"


def is_checkpoint_id(value: str) -> bool:
    return bool(_CHECKPOINT_ID.fullmatch(value))


def check_checkpoint_id(value: str) -> str:
    if not isinstance(value, str) or not _CHECKPOINT_ID.fullmatch(value):
        raise InvalidArgument(
            f"not a checkpoint id: {value!r} (expected YYYYMMDDTHHMMSSZ-<10 hex>)"
        )
    return value


def check_workload(value: str) -> str:
    if not isinstance(value, str) or not _WORKLOAD.fullmatch(value):
        raise InvalidArgument(
            f"not a workload name: {value!r} (letters, digits, '.', '_', '-'; at most 128)"
        )
    return value


def is_workload(value: str) -> bool:
    return isinstance(value, str) and bool(_WORKLOAD.fullmatch(value))


_STORE_ID = re.compile(r"[0-9a-fA-F]{32}")


def is_store_id(value: object) -> bool:
    """A store id as ``config`` holds it (``identity.py``): 32 hex digits."""
    return isinstance(value, str) and bool(_STORE_ID.fullmatch(value))


def is_chunk_id(value: str) -> bool:
    return bool(_CHUNK_ID.fullmatch(value))


def check_relative_path(path: str) -> str:
    """Return ``path`` if it is a safe relative POSIX path; ``Corrupt`` otherwise."""
    if not isinstance(path, str) or not path:
        raise Corrupt("manifest names an empty path")
    if "\0" in path or len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise Corrupt(f"manifest names an invalid path {path[:80]!r}")
    if path.startswith("/") or "\\" in path:
        raise Corrupt(f"manifest names an absolute or non-POSIX path {path!r}")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise Corrupt(f"manifest names a path that is not normalised or climbs out: {path!r}")
    if str(PurePosixPath(path)) != path:
        raise Corrupt(f"manifest names a path that is not normalised: {path!r}")
    return path


@dataclass(frozen=True)
class ChunkRef:
    id: str
    size: int


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    mode: int
    chunks: list[ChunkRef] = field(default_factory=list)


@dataclass
class Manifest:
    checkpoint_id: str
    workload: str
    created_at: float
    parent: str | None
    stamp: dict[str, Any]
    spec: dict[str, Any]
    files: list[FileEntry]
    totals: dict[str, Any]
    extra: dict[str, Any]
    schema_version: int = SCHEMA_VERSION
    # The id of the store the checkpoint was pushed into (docs/design.md, "Binding"); signed
    # with the rest, so the manifest cannot pass in another store. ``None``: a legacy one.
    store_id: str | None = None

    @property
    def node_id(self) -> str | None:
        """The node that made it (the stamp's ``host.node_id``), for key scopes."""
        host = self.stamp.get("host")
        node = host.get("node_id") if isinstance(host, dict) else None
        return node if isinstance(node, str) else None

    def to_dict(self) -> dict[str, Any]:
        bound = {} if self.store_id is None else {"store_id": self.store_id}
        return bound | {
            "schema_version": self.schema_version,
            "checkpoint_id": self.checkpoint_id,
            "workload": self.workload,
            "created_at": self.created_at,
            "parent": self.parent,
            "stamp": self.stamp,
            "spec": self.spec,
            "files": [
                {
                    "path": f.path,
                    "size": f.size,
                    "mode": f.mode,
                    "chunks": [[c.id, c.size] for c in f.chunks],
                }
                for f in self.files
            ],
            "totals": self.totals,
            "extra": self.extra,
        }

    def to_json(self) -> bytes:
        """Canonical JSON: the bytes that are signed."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_ids(self) -> set[str]:
        return {c.id for f in self.files for c in f.chunks}

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Parse and validate; any shape or value problem is ``Corrupt``."""
        try:
            return _parse(data)
        except Corrupt:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, InvalidArgument) as exc:
            raise Corrupt(f"manifest is malformed: {exc}") from exc

    @classmethod
    def from_json(cls, blob: bytes) -> Manifest:
        return cls.from_dict(load_json(blob, "manifest"))


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise Corrupt(f"manifest field {what} is not a non-negative integer")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Corrupt(f"manifest field {what} is not an object")
    return value


def _parse(data: Any) -> Manifest:
    data = _dict(data, "(top level)")
    version = data["schema_version"]
    if version != SCHEMA_VERSION:
        raise Corrupt(
            f"manifest schema_version {version!r} is not supported (want {SCHEMA_VERSION})"
        )
    checkpoint_id = data["checkpoint_id"]
    if not isinstance(checkpoint_id, str) or not is_checkpoint_id(checkpoint_id):
        raise Corrupt(f"manifest has an invalid checkpoint id {checkpoint_id!r}")
    workload = check_workload(data["workload"])
    parent = data.get("parent")
    if parent is not None and (not isinstance(parent, str) or not is_checkpoint_id(parent)):
        raise Corrupt(f"manifest has an invalid parent id {parent!r}")
    created_at = data["created_at"]
    if not isinstance(created_at, int | float) or isinstance(created_at, bool):
        raise Corrupt("manifest field created_at is not a number")
    files: list[FileEntry] = []
    seen: set[str] = set()
    # A chunk is named by its content, so it has one size; two would let a reader fill a
    # file with the wrong bytes (or zero padding) and still pass every hash check.
    chunk_sizes: dict[str, int] = {}
    for item in data["files"]:
        raw = _dict(item, "files[]")
        path = check_relative_path(raw["path"])
        if path in seen:
            raise Corrupt(f"manifest names {path!r} twice")
        seen.add(path)
        size = _int(raw["size"], "size")
        mode = _int(raw["mode"], "mode") & 0o777
        chunks: list[ChunkRef] = []
        for pair in raw["chunks"]:
            chunk_id, chunk_size = pair
            if not isinstance(chunk_id, str) or not is_chunk_id(chunk_id):
                raise Corrupt(f"manifest names an invalid chunk id {chunk_id!r}")
            chunk_size = _int(chunk_size, "chunk size")
            if chunk_sizes.setdefault(chunk_id, chunk_size) != chunk_size:
                raise Corrupt(
                    f"manifest declares chunk {chunk_id} with two sizes "
                    f"({chunk_sizes[chunk_id]} and {chunk_size})"
                )
            chunks.append(ChunkRef(chunk_id, chunk_size))
        if sum(c.size for c in chunks) != size:
            raise Corrupt(f"manifest chunk sizes of {path!r} do not add up to its size")
        files.append(FileEntry(path, size, mode, chunks))
    # A file and a directory of the same name cannot both exist.
    for path in seen:
        parent_dir = path.rpartition("/")[0]
        while parent_dir:
            if parent_dir in seen:
                raise Corrupt(f"manifest uses {parent_dir!r} as both a file and a directory")
            parent_dir = parent_dir.rpartition("/")[0]
    store_id = data.get("store_id")
    if store_id is not None and not is_store_id(store_id):
        raise Corrupt(f"manifest has an invalid store id {str(store_id)[:80]!r}")
    return Manifest(
        store_id=store_id,
        checkpoint_id=checkpoint_id,
        workload=workload,
        created_at=float(created_at),
        parent=parent,
        stamp=_dict(data.get("stamp", {}), "stamp"),
        spec=_dict(data.get("spec", {}), "spec"),
        files=files,
        totals=_dict(data.get("totals", {}), "totals"),
        extra=_dict(data.get("extra", {}), "extra"),
    )


@dataclass(frozen=True)
class ManifestSummary:
    checkpoint_id: str
    workload: str
    created_at: float
    parent: str | None
    bytes_total: int
    files: int

    @classmethod
    def of(cls, manifest: Manifest) -> ManifestSummary:
        return cls(
            manifest.checkpoint_id,
            manifest.workload,
            manifest.created_at,
            manifest.parent,
            manifest.bytes_total,
            len(manifest.files),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
