"""The checkpoint store: content-addressed, authenticated, crash-safe, on a directory or S3.

What it holds: the backends (``file://``, ``s3://``) behind one small protocol, with retry
wrapped around them; the key layout; content-defined chunking, the chunk codec (zstd,
BLAKE3 names, AES-256-GCM) and the manifest; push, pull, verify and gc with the lock
protocol between a push and a gc; signed records for other parts' small objects; the node's
local chunk index (a hint, checked against the store's signed identity and proven before
every commit), and its chunk cache (``storage.cache``; prefetch: ``storage.prefetch``).
Files are cut into chunks named by their hash and uploaded once; a signed manifest, written
last, makes a checkpoint exist. ``open_store`` is the entry point;
``docs/design.md`` documents the format.

This package imports nothing of gpusnap's but itself and ``gpusnap.errors`` (no daemon, no
cli, no proto).
"""

from gpusnap.storage.backend import Backend, BackendOptions, ObjectInfo
from gpusnap.storage.cache import ChunkCache
from gpusnap.storage.context import StoreContext
from gpusnap.storage.identity import StoreIdentity
from gpusnap.storage.keys import (
    UntrustedSigner,
    export_public_key,
    generate_encryption_key,
    generate_signing_key,
    public_key_path,
)
from gpusnap.storage.layout import MIGRATION_PREFIX
from gpusnap.storage.manifest import ChunkRef, FileEntry, Manifest, ManifestSummary
from gpusnap.storage.open import open_backend
from gpusnap.storage.parallel import ProgressFn
from gpusnap.storage.records import SignedRecords
from gpusnap.storage.store import (
    CheckpointStore,
    GcReport,
    PrefetchResult,
    PullResult,
    PushResult,
    StoreCheck,
    VerifyReport,
    open_store,
)

__all__ = [
    "MIGRATION_PREFIX",
    "Backend",
    "BackendOptions",
    "CheckpointStore",
    "ChunkCache",
    "ChunkRef",
    "FileEntry",
    "GcReport",
    "Manifest",
    "ManifestSummary",
    "ObjectInfo",
    "PrefetchResult",
    "ProgressFn",
    "PullResult",
    "PushResult",
    "SignedRecords",
    "StoreCheck",
    "StoreContext",
    "StoreIdentity",
    "UntrustedSigner",
    "VerifyReport",
    "export_public_key",
    "generate_encryption_key",
    "generate_signing_key",
    "open_backend",
    "open_store",
    "public_key_path",
]
