"""The node's content-addressed chunk cache: chunk objects kept on local disk within a budget.

Shared by every pull on the node (each process opens the same directory): the read path asks
it before the store and keeps what the store returned; a push may seed it with what it
uploaded; a standby prefetches into it (``storage/prefetch.py``). Objects are kept exactly as
the store holds them and verified on every read like a store's, so a cached chunk is never
trusted more than a store chunk. Modules: ``disk`` (``ChunkCache``: the budget, LRU
eviction, stats, prune), ``db`` (its SQLite index), ``files`` (the layout on disk),
``writers`` and ``repair`` (what crashed writers left, put right at open), ``view``
(``StoreCache``: one store's scope, what a ``StoreContext`` holds), ``seeding`` (the backend
wrapper a seeding push uses).
``docs/design.md`` ("The node's chunk cache") documents the format.

Imports only ``storage``'s ``backend``, ``chunker``, ``index`` and ``layout``, and
``gpusnap.errors``.
"""

from gpusnap.storage.cache.disk import (
    DEFAULT_CACHE_DIR,
    CacheStats,
    ChunkCache,
    PruneResult,
    ScopeStats,
    scope_of,
)
from gpusnap.storage.cache.view import StoreCache

__all__ = [
    "DEFAULT_CACHE_DIR",
    "CacheStats",
    "ChunkCache",
    "PruneResult",
    "ScopeStats",
    "StoreCache",
    "scope_of",
]
