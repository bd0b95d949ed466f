"""containerd's checkpoint image, exported as an OCI layout: which of its blobs is which part.

The checkpoint index (``ctr containers checkpoint``) names each blob with a media type: the CRIU
images (one uncompressed tar), the rw layer (a gzipped tar), the container spec; the layout's
index, manifests and the runtime options are containerd's own (``PART_RUNTIME``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpusnap.daemon.containers.model import PART_CONFIG, PART_CRIU, PART_ROOTFS, PART_RUNTIME
from gpusnap.errors import Corrupt

_KINDS = {
    "application/vnd.containerd.container.criu.checkpoint.criu.tar": PART_CRIU,
    "application/vnd.oci.image.layer.v1.tar+gzip": PART_ROOTFS,
    "application/vnd.oci.image.layer.v1.tar": PART_ROOTFS,
    "application/vnd.containerd.container.checkpoint.config.v1+proto": PART_CONFIG,
}


# An OCI digest: the only names a blob path is made of (never ``..`` or ``/``).
_DIGEST = re.compile(r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}")


def parts_of_layout(layout: Path) -> dict[str, str]:
    """Each file of the checkpoint image exported as an OCI layout into ``layout`` with its kind,
    from the checkpoint index (the rest is containerd's own). ``Corrupt`` naming the file when
    the index or a manifest is not what containerd writes."""
    parts = {"index.json": PART_RUNTIME, "oci-layout": PART_RUNTIME}
    for top in _descriptors(layout, "index.json"):
        blob = _blob(top, "index.json")
        parts[blob] = PART_RUNTIME
        for d in _descriptors(layout, blob):
            rel = _blob(d, blob)
            if (layout / rel).is_file():
                parts[rel] = _KINDS.get(str(d.get("mediaType")), PART_RUNTIME)
    for f in layout.rglob("*"):
        rel = f.relative_to(layout).as_posix()
        if f.is_file() and rel not in parts and rel != "gpusnap-container.json":
            parts[rel] = PART_RUNTIME
    return parts


def _descriptors(layout: Path, rel: str) -> list[dict[str, object]]:
    """The ``manifests`` of the index or manifest at ``rel``: a list of JSON objects."""
    what = f"containerd checkpoint layout: {rel}"
    try:
        doc = json.loads((layout / rel).read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise Corrupt(f"{what}: {exc}") from exc
    found = doc.get("manifests") if isinstance(doc, dict) else None
    found = found or []
    if not isinstance(found, list) or not all(isinstance(d, dict) for d in found):
        raise Corrupt(f"{what}: manifests is not a list of descriptors")
    return found


def _blob(descriptor: dict[str, object], rel: str) -> str:
    digest = descriptor.get("digest")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise Corrupt(f"containerd checkpoint layout: {rel} names a digest that is not one")
    return f"blobs/{digest.replace(':', '/')}"
