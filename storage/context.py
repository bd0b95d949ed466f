"""The parts of one open store, built once and handed to push, pull, gc and verify.

``StoreContext`` is frozen: the backend, the keys, the chunk codec and chunker, the local
chunk index, the worker pools and the tunables of the lock protocol. Each operation
(``push.py``, ``pull.py``, ``gc.py``, ``verify.py``, ``catalog.py``, ``records.py``) is a
function whose first argument is the context and which uses only the parts it names: none
calls back into ``CheckpointStore``, which only holds a context and delegates to them.

``open_context`` builds one, in this order: keys and options (given), the store's identity
(one GET of its signed ``config``, ``identity.py``: its id and chunking parameters), codec
and chunker (the store's chunk sizes where it has a config), the index (bound to the store
id: an index of another store is emptied), then the pools (last: nothing is left running
when an earlier step fails). Which signatures the node accepts is the keys' (``StoreKeys``:
its own key and its trusted public keys).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.storage.backend import Backend
from gpusnap.storage.cache import ChunkCache, StoreCache
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.codec import ChunkCodec
from gpusnap.storage.highwater import HighWaterMarks
from gpusnap.storage.identity import IdentityCell, StoreIdentity, read_identity
from gpusnap.storage.index import ChunkIndex, default_cache_dir
from gpusnap.storage.keys import StoreKeys

# A lock not refreshed for this long belongs to a dead process.
LOCK_STALE_SECONDS = 900.0
LOCK_REFRESH_SECONDS = 120.0


@dataclass(frozen=True)
class StoreOptions:
    """Tunables of one open store (tests shorten them)."""

    lock_stale_seconds: float = LOCK_STALE_SECONDS
    lock_refresh_seconds: float = LOCK_REFRESH_SECONDS


@dataclass(frozen=True)
class Pools:
    """The store's worker pools, and the bytes its chunks in flight may hold at most.

    ``cpu`` hashes, compresses and decodes (one thread per core: zstd, BLAKE3 and AES-GCM
    release the GIL); ``io`` waits on puts and gets, so it is wider and never idles a core.
    """

    workers: int
    io_workers: int
    budget_bytes: int
    cpu: ThreadPoolExecutor = field(repr=False)
    io: ThreadPoolExecutor = field(repr=False)

    @classmethod
    def start(cls, workers: int, max_chunk: int) -> Pools:
        io_workers = max(8, 2 * workers)
        return cls(
            workers=workers,
            io_workers=io_workers,
            # Bytes in flight (being hashed, compressed, or waiting on a put/get) at most.
            budget_bytes=max(2 * workers, io_workers) * max_chunk,
            cpu=ThreadPoolExecutor(workers, thread_name_prefix="gpusnap-store"),
            io=ThreadPoolExecutor(io_workers, thread_name_prefix="gpusnap-io"),
        )

    def close(self) -> None:
        self.cpu.shutdown(wait=True)
        self.io.shutdown(wait=True)


@dataclass(frozen=True)
class StoreContext:
    """The parts of one open store; see the module docstring."""

    backend: Backend
    keys: StoreKeys
    codec: ChunkCodec
    chunker: Chunker
    index: ChunkIndex
    pools: Pools
    identity: IdentityCell
    options: StoreOptions = StoreOptions()
    # This store's part of the node's chunk cache (``storage/cache``), when there is one.
    cache: StoreCache | None = None
    # The node's high-water marks of head records (``highwater.py``; ``heads.py``).
    marks: HighWaterMarks | None = None

    @property
    def store_identity(self) -> StoreIdentity | None:
        """The store's identity as last read (``None``: it has no usable config yet)."""
        return self.identity.get()

    @property
    def local(self) -> bool:
        """Whether the store is on this machine's disks (its reads outrun its decodes)."""
        return self.backend.url.startswith("file://")

    def close(self) -> None:
        self.pools.close()
        self.index.close()
        self.backend.close()


def open_context(
    backend: Backend,
    keys: StoreKeys,
    *,
    cache_dir: Path | None = None,
    workers: int | None = None,
    chunker: Chunker | None = None,
    options: StoreOptions | None = None,
    chunk_cache: ChunkCache | None = None,
    high_water_file: Path | None = None,
) -> StoreContext:
    """The context of the store on ``backend``; the backend is the caller's to close on error.

    ``chunk_cache`` (the node's, the caller's to close) is read before the store and filled
    from it; the context uses this store's scope of it only (``cache_key``).
    ``high_water_file`` keeps the node's marks of head records (default: ``heads.json`` in
    the cache dir).
    """
    found = read_identity(backend, keys)
    if chunker is None:
        chunker = Chunker(found.identity.chunking) if found.identity else Chunker()
    cache = cache_dir or default_cache_dir(backend.url)
    codec = ChunkCodec(keys.encryption)
    index = ChunkIndex(cache / "index.sqlite", backend.url)
    try:
        # Only an authenticated identity rebinds (and so may empty) the index here: a reader
        # that cannot check the config (no key, say) leaves it to the next push.
        if found.identity is not None:
            index.bind(found.identity.store_id)
        pools = Pools.start(workers or (os.cpu_count() or 2), chunker.params.max_size)
    except BaseException:
        index.close()
        raise
    return StoreContext(
        backend=backend,
        keys=keys,
        codec=codec,
        chunker=chunker,
        index=index,
        pools=pools,
        identity=IdentityCell(found),
        options=options or StoreOptions(),
        cache=None if chunk_cache is None else _store_cache(chunk_cache, backend, codec),
        marks=HighWaterMarks(high_water_file or cache / "heads.json"),
    )


def cache_key(backend: Backend) -> str:
    """What the node's chunk cache knows this store by: its URL. Not the store id (issue 12):
    the cache only ever serves objects that are verified against their chunk id on every
    read, so it needs no identity to be safe, and keying it by the id would throw away every
    cached object of a store that gets (or changes) one: a migrated store, or one recreated
    while this node still holds the chunks its checkpoints need."""
    return backend.url


def _store_cache(cache: ChunkCache, backend: Backend, codec: ChunkCodec) -> StoreCache:
    # The id the store would give a fixed string: the same for every reader with the same
    # chunk-naming key (none, or the encryption key), different for any other, and saying
    # nothing about the key. Objects read with another key never meet this one's.
    fingerprint = codec.chunk_id(b"gpusnap chunk cache scope")
    return StoreCache.open(cache, cache_key(backend), fingerprint, backend.url)
