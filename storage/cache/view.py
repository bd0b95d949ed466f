"""``StoreCache``: one store's part of the node's chunk cache, what a ``StoreContext`` holds.

The read path asks it before the store and gives it what the store returned once that
decoded and verified (``pull.fetch_chunk``); a push that seeds the cache gives it what it
uploaded (``seeding.py``). It holds objects, never decoded content, and says nothing about
them: whoever reads one decodes and verifies it, and drops it (``discard``) if it fails.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpusnap.storage.cache.disk import ChunkCache, scope_of


class StoreCache:
    """The objects of one store (one scope) in a ``ChunkCache``."""

    def __init__(self, cache: ChunkCache, scope: str) -> None:
        self.cache = cache
        self.scope = scope

    @classmethod
    def open(cls, cache: ChunkCache, store_key: str, fingerprint: str, label: str) -> StoreCache:
        """The scope of the store ``store_key`` read with the chunk-naming key whose
        ``fingerprint`` is given (``scope_of``); ``label`` is what ``gpusnap cache stats``
        shows for it (the store's URL)."""
        scope = scope_of(store_key, fingerprint)
        cache.register(scope, label)
        return cls(cache, scope)

    @property
    def max_bytes(self) -> int:
        return self.cache.max_bytes

    def get(self, chunk_id: str) -> bytes | None:
        return self.cache.get(self.scope, chunk_id)

    def put(self, chunk_id: str, obj: bytes) -> bool:
        return self.cache.put(self.scope, chunk_id, obj)

    def discard(self, chunk_id: str, reason: str) -> None:
        self.cache.discard(self.scope, chunk_id, reason)

    def present(self, chunk_ids: Iterable[str]) -> dict[str, int]:
        return self.cache.present(self.scope, chunk_ids)

    def touch(self, chunk_ids: Iterable[str]) -> None:
        self.cache.touch(self.scope, chunk_ids)
