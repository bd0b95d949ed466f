"""Verification of a store: manifests readable and authentic, every chunk they name present.

``verify_store`` reads the manifests (all, or the checkpoints asked for), then lists the
chunks once and reports each referenced chunk that is missing. With ``read_data`` it also
fetches every referenced chunk and decodes it against the size the manifests declare, which
re-checks its hash. Objects under ``manifests/`` that are not manifest keys are reported as
strays; no reader uses them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpusnap.errors import Corrupt, NotFound
from gpusnap.storage.catalog import find_manifest_key, read_manifest
from gpusnap.storage.context import StoreContext
from gpusnap.storage.layout import (
    CHUNK_PREFIX,
    MANIFEST_PREFIX,
    chunk_id_of_key,
    chunk_key,
    split_manifest_key,
)


@dataclass
class VerifyReport:
    checkpoints: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    chunks_missing: list[str] = field(default_factory=list)
    chunks_corrupt: list[str] = field(default_factory=list)
    manifests_bad: list[str] = field(default_factory=list)
    # Objects under manifests/ that are not manifest keys (ignored by every reader).
    strays: list[str] = field(default_factory=list)
    read_data: bool = False

    @property
    def ok(self) -> bool:
        return not (self.chunks_missing or self.chunks_corrupt or self.manifests_bad or self.strays)

    @property
    def problems(self) -> list[str]:
        return (
            [f"manifest {m}" for m in self.manifests_bad]
            + [
                f"stray object {k!r} under {MANIFEST_PREFIX} (not a manifest; ignored)"
                for k in self.strays
            ]
            + [f"missing chunk {c}" for c in self.chunks_missing]
            + [f"corrupt chunk {c}" for c in self.chunks_corrupt]
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["problems"] = self.problems
        return out


def verify_store(ctx: StoreContext, ids: list[str] | None, *, read_data: bool) -> VerifyReport:
    """Check the manifests of ``ids`` (all when ``None``) and the chunks they reference.

    With ``read_data`` the chunks are fetched and decoded on the CPU pool.
    """
    backend = ctx.backend
    report = VerifyReport(read_data=read_data)
    if ids is None:
        keys = []
        for info in backend.list(MANIFEST_PREFIX):
            if split_manifest_key(info.key) is None:
                report.strays.append(info.key)
            else:
                keys.append(info.key)
    else:
        keys = [find_manifest_key(backend, i) for i in ids]
    referenced: dict[str, str] = {}  # chunk id -> a checkpoint that uses it
    sizes: dict[str, int] = {}  # chunk id -> its size, as the manifests declare it
    for key in keys:
        checkpoint_id = key.rpartition("/")[2]
        try:
            manifest = read_manifest(ctx, key)
        except (Corrupt, NotFound) as exc:
            report.manifests_bad.append(f"{checkpoint_id}: {exc}")
            continue
        report.checkpoints.append(checkpoint_id)
        for entry in manifest.files:
            for ref in entry.chunks:
                referenced.setdefault(ref.id, checkpoint_id)
                if sizes.setdefault(ref.id, ref.size) != ref.size:
                    report.chunks_corrupt.append(
                        f"{ref.id}: declared with {sizes[ref.id]} bytes by checkpoint "
                        f"{referenced[ref.id]} and {ref.size} by {checkpoint_id}"
                    )
    present = {cid for info in backend.list(CHUNK_PREFIX) if (cid := chunk_id_of_key(info.key))}
    for chunk_id, checkpoint_id in sorted(referenced.items()):
        if chunk_id not in present:
            report.chunks_missing.append(f"{chunk_id} (checkpoint {checkpoint_id})")
    report.chunks_checked = len(referenced)
    if read_data:
        to_read = [c for c in referenced if c in present]

        def check(chunk_id: str) -> str | None:
            try:
                obj = backend.get(chunk_key(chunk_id))
                ctx.codec.decode(chunk_id, obj, sizes[chunk_id])
            except (Corrupt, NotFound) as exc:
                return f"{chunk_id} (checkpoint {referenced[chunk_id]}): {exc}"
            return None

        for problem in ctx.pools.cpu.map(check, to_read):
            if problem is not None:
                report.chunks_corrupt.append(problem)
    return report
