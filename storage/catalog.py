"""The checkpoints a store holds: manifests found by id, read and authenticated, listed, written.

A manifest lives at ``manifests/<workload>/<checkpoint id>`` (``layout.manifest_key``) as a
sealed envelope (``keys.seal``). Reading checks the seal and that the manifest describes the
checkpoint its key names; listing skips objects under ``manifests/`` that are not manifest
keys, and leaves out manifests that fail their checks, saying which and why. Writing is the
commit of a push: the object is created only if absent, so a checkpoint is never replaced.
"""

from __future__ import annotations

import logging

from gpusnap.errors import (
    AlreadyExists,
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    NotFound,
)
from gpusnap.storage.backend import Backend
from gpusnap.storage.binding import check_store_binding
from gpusnap.storage.context import StoreContext
from gpusnap.storage.layout import (
    MANIFEST_PREFIX,
    manifest_key,
    manifest_prefix,
    split_manifest_key,
)
from gpusnap.storage.manifest import (
    ENVELOPE_FORMAT,
    Manifest,
    ManifestSummary,
    check_checkpoint_id,
)
from gpusnap.storage.untrusted import MAX_MANIFEST_BYTES, read_capped

log = logging.getLogger(__name__)


def manifest_keys(backend: Backend, checkpoint_id: str, workload: str | None = None) -> list[str]:
    """The keys of every manifest named ``checkpoint_id``, ``workload``'s first (one LIST).

    An id is unique among the checkpoints a push writes, but anyone who can write to the
    store can put an object under the same id in another workload's folder.
    """
    check_checkpoint_id(checkpoint_id)
    found = [
        info.key
        for info in backend.list(MANIFEST_PREFIX)
        if (parts := split_manifest_key(info.key)) is not None and parts[1] == checkpoint_id
    ]
    found.sort(key=lambda key: split_manifest_key(key) != (workload, checkpoint_id))
    return found


def find_manifest_key(backend: Backend, checkpoint_id: str) -> str:
    """The key of checkpoint ``checkpoint_id``'s manifest, whatever its workload (one LIST)."""
    found = manifest_keys(backend, checkpoint_id)
    if not found:
        raise NotFound(f"checkpoint {checkpoint_id} not found")
    return found[0]


def read_manifest(ctx: StoreContext, key: str, *, verify: bool | None = None) -> Manifest:
    """The manifest stored at ``key``, opened and (unless ``verify`` is off) authenticated.

    ``verify`` defaults to the store's setting.
    """
    parts = split_manifest_key(key)
    if parts is None:
        raise Corrupt(f"store object {key} is not a manifest key")
    workload, checkpoint_id = parts
    what = f"manifest {checkpoint_id}"
    blob = read_capped(ctx.backend, key, MAX_MANIFEST_BYTES, what)
    payload = ctx.keys.unseal(blob, ENVELOPE_FORMAT, what=what, verify=verify)
    manifest = Manifest.from_json(payload)
    if manifest.checkpoint_id != checkpoint_id or manifest.workload != workload:
        raise Corrupt(f"manifest {key} describes {manifest.workload}/{manifest.checkpoint_id}")
    if verify is not False:  # bound to this store, signed within its key's scope
        check_store_binding(ctx, manifest.store_id, what)
        ctx.keys.check_scope(blob, workload, manifest.node_id, what)
    return manifest


def fetch_manifest(ctx: StoreContext, checkpoint_id: str, workload: str | None = None) -> Manifest:
    """The checkpoint's manifest, found, fetched and authenticated (``NotFound``/``Corrupt``).

    ``workload``'s is tried first; then any other object under the id, so that one planted
    in another workload's folder never hides the real one. When none holds, the error is
    the first one's (the named workload's, if it has one).
    """
    first: GpusnapError | None = None
    for key in manifest_keys(ctx.backend, checkpoint_id, workload):
        try:
            return read_manifest(ctx, key)
        except (Corrupt, FailedPrecondition, NotFound) as exc:
            first = first or exc
            log.warning("%s: %s", key, exc)
    raise first or NotFound(f"checkpoint {checkpoint_id} not found")


def list_manifests(
    ctx: StoreContext, workload: str | None
) -> tuple[list[ManifestSummary], list[tuple[str, GpusnapError]]]:
    """Summaries of the checkpoints (of ``workload``), newest first, and those left out.

    One that cannot be read (not authenticated, the wrong key, altered) is left out of the
    list and returned with why; one deleted while listing is simply gone.
    """
    out: list[ManifestSummary] = []
    skipped: list[tuple[str, GpusnapError]] = []
    for info in ctx.backend.list(manifest_prefix(workload)):
        if split_manifest_key(info.key) is None:
            log.warning("skipping %r: not a manifest key", info.key)
            continue
        try:
            out.append(ManifestSummary.of(read_manifest(ctx, info.key)))
        except (Corrupt, NotFound, FailedPrecondition) as exc:
            if not isinstance(exc, NotFound):  # deleted while we listed: not a problem
                skipped.append((info.key, exc))
            log.warning("skipping %s: %s", info.key, exc)
    out.sort(key=lambda s: (s.created_at, s.checkpoint_id), reverse=True)
    return out, skipped


def checkpoint_ids(ctx: StoreContext, workload: str) -> list[str]:
    """The ids of ``workload``'s checkpoints, newest first by the time in the id (one LIST;
    nothing is read, so nothing is authenticated yet: read the one you use)."""
    ids = [
        parts[1]
        for info in ctx.backend.list(manifest_prefix(workload))
        if (parts := split_manifest_key(info.key)) is not None and parts[0] == workload
    ]
    return sorted(ids, reverse=True)


def write_manifest(ctx: StoreContext, manifest: Manifest) -> None:
    """Seal ``manifest`` and create its object: the checkpoint exists from here on.

    ``AlreadyExists`` if a checkpoint with its id does.
    """
    blob = ctx.keys.seal(ENVELOPE_FORMAT, manifest.to_json())
    try:
        ctx.backend.put(
            manifest_key(manifest.workload, manifest.checkpoint_id), blob, if_absent=True
        )
    except AlreadyExists as exc:
        raise AlreadyExists(f"checkpoint {manifest.checkpoint_id} already exists") from exc
