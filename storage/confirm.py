"""What the local chunk index may be trusted for, and what a push proves instead of trusting it.

The index (``index.py``) says which chunks the store holds, so that a push need not ask per
chunk. It can be wrong in ways it cannot see: the store was recreated under the same URL (a
directory wiped, a bucket emptied or recreated), restored from an older backup, or lost a
chunk behind gpusnap's back (an operator's ``rm``, a lifecycle rule, a bad disk). So:

- **identity** (``refresh_identity``): every push reads the store's config again (one GET),
  writes one if the store has none, and binds the index to the store id; an index of another
  id (or of none) is emptied and rebuilt from a LIST before anything is skipped. This catches
  a recreated store at the start, so the push uploads instead of skipping.
- **proof** (``ChunkProof``): the index is used only to decide what to upload. Every chunk
  the push did not upload because the index listed it is proven present in the store before
  the manifest is written -- by HEADs when they are few, else by one LIST of ``chunks/`` (16
  listings at once on a large store) -- and whatever is missing is uploaded again (or, for a
  stream, which cannot be read twice, the push fails uncommitted). This is what catches a
  store restored from a backup (same id, chunks missing) and a chunk deleted behind the
  store's back. When the push follows a parent, the proof of the parent's chunks starts with
  the push, beside the hashing, so it costs the push little wall time.
- gc deletions are the lock protocol's (``locks.py``): a gc that swept during the push makes
  the commit wait for it and re-list, whatever the proof saw earlier.

What remains: a chunk deleted by something other than gpusnap's gc *after* the proof saw it
and before the manifest commits (at most the push's duration when the proof started with the
push). The daemon's background check (``verify.check_chunks``) finds such damage later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from gpusnap.errors import FailedPrecondition
from gpusnap.storage.context import StoreContext
from gpusnap.storage.identity import (
    IdentityRead,
    StoreIdentity,
    create_identity,
    read_identity,
)
from gpusnap.storage.layout import chunk_id_of_key, chunk_key, chunk_list_prefixes

log = logging.getLogger(__name__)

# A LIST page holds up to 1000 keys and costs about as much client time as this many HEADs
# (parsing 1000 entries against one small response): below that, HEADs are cheaper.
LIST_PAGE_KEYS = 1000
HEADS_PER_LIST_PAGE = 8
# A store with more chunks than this (by the index's count) is listed 16 ways at once.
PARALLEL_LIST_ABOVE = 4 * LIST_PAGE_KEYS


def refresh_identity(ctx: StoreContext) -> StoreIdentity | None:
    """The store's identity for a push: read again, written if absent, the index bound to it.

    ``None`` when the store holds a config this node cannot authenticate (altered, or signed
    by a key it does not trust): it is not used (``identity.py``), and the index is bound to
    the config object's digest instead.
    """
    found = read_identity(ctx.backend, ctx.keys)
    if found.identity is None and found.problem is None:
        created = create_identity(ctx.backend, ctx.keys, ctx.chunker.params)
        found = IdentityRead(created, digest=None)
    identity = found.identity
    if identity is not None:
        identity.check_writer(ctx.keys)
        if identity.chunking != ctx.chunker.params:
            raise FailedPrecondition(
                f"the store was made with chunk sizes {identity.chunking}, not the "
                f"{ctx.chunker.params} this open store cuts with (recreated? open it again)"
            )
    ctx.identity.set(found)
    key = found.index_key
    if key is not None and ctx.index.bind(key):
        log.info(
            "%s: the chunk index described another store (now %s); it is rebuilt",
            ctx.backend.url,
            key,
        )
    return identity


def list_chunk_ids(ctx: StoreContext, stop: threading.Event | None = None) -> set[str]:
    """Every chunk id the store holds, by LIST (16 listings at once on a large store);
    ``stop`` ends the listings early (their result is then of no use)."""
    ways = 16 if ctx.index.count() > PARALLEL_LIST_ABOVE else 1

    def listed(prefix: str) -> set[str]:
        found: set[str] = set()
        for info in ctx.backend.list(prefix):
            if stop is not None and stop.is_set():
                break
            if cid := chunk_id_of_key(info.key):
                found.add(cid)
        return found

    found: set[str] = set()
    for part in ctx.pools.io.map(listed, chunk_list_prefixes(ways)):
        found |= part
    return found


@dataclass
class ProofStats:
    """How a push proved the chunks it skipped (``PushResult`` carries these)."""

    method: str = "none"  # "none" (nothing skipped), "head", "list", or "head+list"
    chunks_proven: int = 0  # skipped chunks proven present
    chunks_missing: int = 0  # skipped chunks the store turned out not to hold
    wait_seconds: float = 0.0  # how long the commit waited on the proof

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ChunkProof:
    """Proof that the chunks a push skipped on the index's word are in the store.

    ``start(predicted)`` begins proving, on a thread of its own, the chunks the push expects
    to skip (its parent's, where the index lists them); ``missing(skipped)`` finishes the
    proof for what was really skipped and returns the ids the store does not hold.
    """

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self._present: set[str] = set()
        self._absent: set[str] = set()
        self._listed = False  # a full LIST ran: any id not in _present is absent
        self._methods: list[str] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self.stats = ProofStats()

    def start(self, predicted: Collection[str]) -> None:
        if not predicted:
            return

        def run() -> None:
            try:
                # Off the push's thread: a 140 GB parent is ~70,000 index lookups.
                ids = {i for i in predicted if self._ctx.index.contains(i)}
                if ids:
                    self._prove(ids)
            except BaseException as exc:  # raised by missing(), in the push's thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="gpusnap-proof", daemon=True)
        self._thread.start()

    def _prove(self, ids: set[str]) -> None:
        pages = max(1, -(-self._ctx.index.count() // LIST_PAGE_KEYS))
        if len(ids) <= HEADS_PER_LIST_PAGE * pages:
            self._methods.append("head")
            ordered = sorted(ids)
            backend = self._ctx.backend
            found = self._ctx.pools.io.map(lambda c: backend.stat(chunk_key(c)), ordered)
            for chunk_id, info in zip(ordered, found, strict=True):
                (self._present if info is not None else self._absent).add(chunk_id)
        else:
            self._methods.append("list")
            self._present |= list_chunk_ids(self._ctx, self._stop)
            self._listed = True

    def close(self) -> None:
        """Wait for the proof started by ``start`` to finish."""
        if self._thread is not None:
            self._thread.join()

    def abandon(self) -> None:
        """A proof nobody will use (the push failed, or proves again after a gc): its
        listing stops at the next object, and nobody waits for it."""
        self._stop.set()

    def missing(self, skipped: Collection[str]) -> set[str]:
        """The ids of ``skipped`` the store does not hold (each proven one way or the other)."""
        started = time.monotonic()
        self.close()
        if self._error is not None:
            raise self._error
        wanted = set(skipped)
        if not self._listed:
            todo = wanted - self._present - self._absent
            if todo:
                self._prove(todo)
        absent = wanted - self._present if self._listed else wanted & self._absent
        self.stats = ProofStats(
            method="+".join(dict.fromkeys(self._methods)) if wanted else "none",
            chunks_proven=len(wanted) - len(absent),
            chunks_missing=len(absent),
            wait_seconds=time.monotonic() - started,
        )
        if absent:
            log.warning(
                "%s: %d chunks the local index listed are not in the store (recreated, "
                "restored from a backup, or deleted behind gpusnap's back); uploading them again",
                self._ctx.backend.url,
                len(absent),
            )
        return absent
