"""containerd's checkpoint image, exported as an OCI layout: which of its blobs is which part.

The checkpoint index (``ctr containers checkpoint``) names each blob with a media type: the CRIU
images (one uncompressed tar), the rw layer (a gzipped tar), the container spec; the layout's
index, manifests and the runtime options are containerd's own (``PART_RUNTIME``).
"""

from __future__ import annotations

import json
from pathlib import Path

from gpusnap.daemon.containers.model import PART_CONFIG, PART_CRIU, PART_ROOTFS, PART_RUNTIME

_KINDS = {
    "application/vnd.containerd.container.criu.checkpoint.criu.tar": PART_CRIU,
    "application/vnd.oci.image.layer.v1.tar+gzip": PART_ROOTFS,
    "application/vnd.oci.image.layer.v1.tar": PART_ROOTFS,
    "application/vnd.containerd.container.checkpoint.config.v1+proto": PART_CONFIG,
}


def parts_of_layout(layout: Path) -> dict[str, str]:
    """Each file of the checkpoint image exported as an OCI layout into ``layout`` with its kind,
    from the checkpoint index (the rest is containerd's own)."""
    parts = {"index.json": PART_RUNTIME, "oci-layout": PART_RUNTIME}
    index = json.loads((layout / "index.json").read_text())
    for top in index.get("manifests") or ():
        blob = f"blobs/{top['digest'].replace(':', '/')}"
        parts[blob] = PART_RUNTIME
        inner = json.loads((layout / blob).read_text())
        for d in inner.get("manifests") or ():
            rel = f"blobs/{d['digest'].replace(':', '/')}"
            if (layout / rel).is_file():
                parts[rel] = _KINDS.get(str(d.get("mediaType")), PART_RUNTIME)
    for f in layout.rglob("*"):
        rel = f.relative_to(layout).as_posix()
        if f.is_file() and rel not in parts and rel != "gpusnap-container.json":
            parts[rel] = PART_RUNTIME
    return parts
