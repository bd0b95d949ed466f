"""A backend that also keeps, in the node's chunk cache, every chunk object put through it.

A push that seeds the cache (``push(..., seed_cache=True)``: the daemon, for its own
checkpoints) runs on a context whose backend is wrapped in this: what a node just pushed, it
holds, as the very objects it uploaded (no second encode). Only chunk keys are kept, and only
once the store's put has returned; a cache that cannot keep one never fails the push.
Everything else passes through unchanged, ``DeferredSyncBackend`` included where the store
offers it (``backend.put_deferred`` then picks the same call it would without the cache).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpusnap.storage.backend import Backend, DeferredSyncBackend
from gpusnap.storage.cache.view import StoreCache
from gpusnap.storage.layout import chunk_id_of_key
from gpusnap.storage.passthrough import PassThroughBackend


class SeedingBackend(PassThroughBackend):
    """``inner``, with every chunk object put also given to ``cache``."""

    def __init__(self, inner: Backend, cache: StoreCache) -> None:
        super().__init__(inner)
        self._cache = cache

    def _seed(self, key: str, data: bytes) -> None:
        chunk_id = chunk_id_of_key(key)
        if chunk_id is not None:
            self._cache.put(chunk_id, data)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        super().put(key, data, if_absent=if_absent)
        self._seed(key, data)

    def close(self) -> None:
        """Nothing: the wrapped backend is its context's to close."""


class _DeferredSeedingBackend(SeedingBackend):
    def __init__(self, inner: DeferredSyncBackend, backend: Backend, cache: StoreCache) -> None:
        super().__init__(backend, cache)
        self._deferred = inner

    def put_unsynced(self, key: str, data: bytes) -> None:
        self._deferred.put_unsynced(key, data)
        self._seed(key, data)

    def sync(self, keys: Iterable[str] | None = None) -> None:
        self._deferred.sync(keys)


def seeding(backend: Backend, cache: StoreCache) -> Backend:
    """``backend``, seeding ``cache`` with the chunk objects put through it."""
    if isinstance(backend, DeferredSyncBackend):
        return _DeferredSeedingBackend(backend, backend, cache)
    return SeedingBackend(backend, cache)
