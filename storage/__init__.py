"""The checkpoint store: content-addressed, authenticated, crash-safe, on a directory or S3.

Files are cut into content-defined chunks named by their hash, compressed, optionally
encrypted, and uploaded once; a signed manifest, written last, makes a checkpoint exist.
``open_store`` is the entry point; ``docs/design.md`` documents the format.

This package imports nothing of gpusnap's but itself (no daemon, no cli, no proto).
"""

from gpusnap.storage.backend import Backend, BackendOptions, ObjectInfo, open_backend
from gpusnap.storage.keys import export_public_key, generate_encryption_key, generate_signing_key
from gpusnap.storage.manifest import ChunkRef, FileEntry, Manifest, ManifestSummary
from gpusnap.storage.pipeline import ProgressFn
from gpusnap.storage.store import (
    CheckpointStore,
    GcReport,
    PullResult,
    PushResult,
    VerifyReport,
    open_store,
)

__all__ = [
    "Backend",
    "BackendOptions",
    "CheckpointStore",
    "ChunkRef",
    "FileEntry",
    "GcReport",
    "Manifest",
    "ManifestSummary",
    "ObjectInfo",
    "ProgressFn",
    "PullResult",
    "PushResult",
    "VerifyReport",
    "export_public_key",
    "generate_encryption_key",
    "generate_signing_key",
    "open_backend",
    "open_store",
]
