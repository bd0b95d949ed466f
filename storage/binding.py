"""Binding a signed object to its store: the store id a manifest or head record was signed
for must be the id of the store it is read from (docs/design.md, "Freshness and binding").

A legacy object (no ``store_id``: signed before the field existed) is accepted, with one
note per store; so is any object while the store's own identity is not known (no ``config``,
or one this node cannot authenticate: that is already a loud warning on every open, and the
binding is then as strong as the config, which a writer could replace anyway).
"""

from __future__ import annotations

import logging
import threading

from gpusnap.errors import Corrupt
from gpusnap.storage.context import StoreContext
from gpusnap.storage.identity import read_identity

log = logging.getLogger(__name__)

_noted: set[tuple[str, str]] = set()
_noted_lock = threading.Lock()


class StoreMismatch(Corrupt):
    """A signed object names another store's id: copied (replayed) from that store."""


def note_once(ctx: StoreContext, topic: str, text: str) -> None:
    """Log ``text`` once per store and ``topic`` in this process (upgrade notes)."""
    with _noted_lock:
        if (ctx.backend.url, topic) in _noted:
            return
        _noted.add((ctx.backend.url, topic))
    log.warning("%s: %s", ctx.backend.url, text)


def check_store_binding(ctx: StoreContext, claimed: str | None, what: str) -> None:
    """Refuse (``StoreMismatch``, exit 4) ``what`` signed for store ``claimed`` when this
    store is another; see the module docstring for what passes unchecked."""
    if not ctx.keys.verify:
        return
    if claimed is None:
        note_once(
            ctx,
            "legacy",
            f"{what} (and maybe others) carries no store id: made before checkpoints were bound "
            "to their store, so it is accepted as legacy (docs/design.md, 'Binding')",
        )
        return
    identity = ctx.store_identity
    if identity is None or identity.store_id == claimed:
        return
    # A long-lived handle (the daemon's) may know a store recreated under it: read it again.
    fresh = read_identity(ctx.backend, ctx.keys).identity
    if fresh is None or fresh.store_id == claimed:
        return
    raise StoreMismatch(
        f"{what} was signed for store {claimed}, but this store is {fresh.store_id} "
        "(copied from another store?)"
    )
