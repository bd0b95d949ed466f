"""Verification of a store: manifests readable and authentic, every chunk they name present.

``verify_store`` reads the manifests (all, or the checkpoints asked for), then lists the
chunks and reports each referenced chunk that is missing, and every checkpoint that names
one (*damaged*). Without ``read_data`` that is all it checked: the chunks are **present**,
not verified. With ``read_data`` it also fetches every referenced chunk and decodes it
against the size the manifests declare, which re-checks its hash. Objects under
``manifests/`` that are not manifest keys are reported as strays; no reader uses them.

``check_chunks`` is the same presence check for the daemon's schedule (``[store]
check_interval``): one LIST of the manifests and one of the chunks, for given checkpoints,
returning each damaged checkpoint's missing chunks.

Both tell the local index what they found: a missing chunk is dropped from it and a corrupt
one marked bad, so the next push uploads it again (which also repairs every checkpoint that
names it: chunks are named by their content).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from gpusnap.errors import Corrupt, NotFound
from gpusnap.storage.catalog import find_manifest_key, manifest_keys, read_manifest
from gpusnap.storage.confirm import list_chunk_ids
from gpusnap.storage.context import StoreContext
from gpusnap.storage.keys import UntrustedSigner
from gpusnap.storage.layout import MANIFEST_PREFIX, split_manifest_key
from gpusnap.storage.pull import read_chunk_object

# What a verify without ``read_data`` checked, and what one with it did: the words the CLI
# prints and the ``checked`` field of ``--json``.
CHECKED_PRESENT = "chunks present"
CHECKED_READ = "chunks read and verified"


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
    # Checkpoint id -> the ids of its chunks that are missing or corrupt.
    damaged: dict[str, list[str]] = field(default_factory=dict)
    # Chunks dropped from (or marked bad in) the local index, so the next push puts them.
    index_dropped: int = 0
    store_id: str | None = None
    # The store's config object fails its checks (altered, unsigned, malformed): a problem.
    config_problems: list[str] = field(default_factory=list)
    # What is worth saying and is not damage: a config signed by a key this node does not
    # trust (a retired key, say) is not used, and nothing else depends on it.
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.chunks_missing
            or self.chunks_corrupt
            or self.manifests_bad
            or self.strays
            or self.config_problems
        )

    @property
    def checked(self) -> str:
        return CHECKED_READ if self.read_data else CHECKED_PRESENT

    @property
    def problems(self) -> list[str]:
        return (
            [f"store config: {c}" for c in self.config_problems]
            + [f"manifest {m}" for m in self.manifests_bad]
            + [
                f"stray object {k!r} under {MANIFEST_PREFIX} (not a manifest; ignored)"
                for k in self.strays
            ]
            + [f"missing chunk {c}" for c in self.chunks_missing]
            + [f"corrupt chunk {c}" for c in self.chunks_corrupt]
            + [
                f"damaged checkpoint {cid}: {len(ids)} chunk(s) missing or corrupt"
                for cid, ids in sorted(self.damaged.items())
            ]
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["checked"] = self.checked
        out["checkpoints_damaged"] = sorted(self.damaged)
        out["problems"] = self.problems
        return out


@dataclass
class StoreCheck:
    """The result of ``check_chunks``: which checkpoints name chunks the store lacks."""

    checked_at: float  # when the check started (epoch seconds)
    seconds: float
    checkpoints: list[str]  # checked (their manifests were read)
    missing: dict[str, list[str]]  # damaged checkpoint id -> its missing chunk ids
    chunks_checked: int  # distinct chunks the checkpoints name
    chunks_missing: int  # distinct chunks of those the store lacks
    manifests_bad: list[str]  # "id: why" for manifests that could not be read
    not_found: list[str]  # checkpoints asked for that no longer exist (retention, say)

    @property
    def damaged(self) -> list[str]:
        return sorted(self.missing)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["damaged"] = self.damaged
        return out


@dataclass
class _Survey:
    """The manifests read and the chunks they name (chunk id -> checkpoints, sizes)."""

    checkpoints: list[str] = field(default_factory=list)
    users: dict[str, list[str]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)


def _survey(ctx: StoreContext, keys: list[str]) -> _Survey:
    out = _Survey()
    for key in keys:
        checkpoint_id = key.rpartition("/")[2]
        try:
            manifest = read_manifest(ctx, key)
        except (Corrupt, NotFound) as exc:  # no key at all (FailedPrecondition) is raised
            out.bad.append(f"{checkpoint_id}: {exc}")
            continue
        out.checkpoints.append(checkpoint_id)
        for entry in manifest.files:
            for ref in entry.chunks:
                users = out.users.setdefault(ref.id, [])
                if not users or users[-1] != checkpoint_id:
                    users.append(checkpoint_id)
                if out.sizes.setdefault(ref.id, ref.size) != ref.size:
                    out.conflicts.append(
                        f"{ref.id}: declared with {out.sizes[ref.id]} bytes by checkpoint "
                        f"{users[0]} and {ref.size} by {checkpoint_id}"
                    )
    return out


def _manifest_keys(ctx: StoreContext) -> tuple[dict[str, str], list[str]]:
    """Checkpoint id -> manifest key, from one LIST; and the stray keys under manifests/."""
    keys: dict[str, str] = {}
    strays: list[str] = []
    for info in ctx.backend.list(MANIFEST_PREFIX):
        parts = split_manifest_key(info.key)
        if parts is None:
            strays.append(info.key)
        else:
            keys[parts[1]] = info.key
    return keys, strays


def _damage(survey: _Survey, bad_chunks: Collection[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for chunk_id in sorted(bad_chunks):
        for checkpoint_id in survey.users.get(chunk_id, ()):
            out.setdefault(checkpoint_id, []).append(chunk_id)
    return out


def verify_store(ctx: StoreContext, ids: list[str] | None, *, read_data: bool) -> VerifyReport:
    """Check the manifests of ``ids`` (all when ``None``) and the chunks they reference.

    With ``read_data`` the chunks are fetched and decoded on the CPU pool.
    """
    identity = ctx.store_identity
    report = VerifyReport(read_data=read_data, store_id=identity.store_id if identity else None)
    config_problem = ctx.identity.problem
    if isinstance(config_problem, UntrustedSigner):
        report.warnings.append(f"store config not used: {config_problem}")
    elif config_problem is not None:
        report.config_problems.append(str(config_problem))
    if ids is None:
        by_id, report.strays = _manifest_keys(ctx)
        keys = list(by_id.values())
    else:
        # Every object under each id: one planted beside the real manifest is reported.
        keys = [
            k
            for i in ids
            for k in manifest_keys(ctx.backend, i) or [find_manifest_key(ctx.backend, i)]
        ]
    survey = _survey(ctx, keys)
    report.checkpoints = survey.checkpoints
    report.manifests_bad = survey.bad
    report.chunks_corrupt = list(survey.conflicts)
    present = list_chunk_ids(ctx)
    missing = sorted(c for c in survey.users if c not in present)
    report.chunks_missing = [f"{c} (checkpoint {', '.join(survey.users[c])})" for c in missing]
    report.chunks_checked = len(survey.users)
    corrupt: list[str] = []
    if read_data:
        to_read = [c for c in survey.users if c in present]

        def check(chunk_id: str) -> str | None:
            try:
                obj = read_chunk_object(ctx, chunk_id)
                ctx.codec.decode(chunk_id, obj, survey.sizes[chunk_id])
            except (Corrupt, NotFound) as exc:
                return f"{exc}"
            return None

        for chunk_id, problem in zip(to_read, ctx.pools.cpu.map(check, to_read), strict=True):
            if problem is not None:
                corrupt.append(chunk_id)
                users = ", ".join(survey.users[chunk_id])
                report.chunks_corrupt.append(f"{chunk_id} (checkpoint {users}): {problem}")
    report.damaged = _damage(survey, [*missing, *corrupt])
    ctx.index.discard(missing)
    ctx.index.mark_bad(corrupt)
    report.index_dropped = len(missing) + len(corrupt)
    return report


def check_chunks(ctx: StoreContext, ids: Collection[str] | None) -> StoreCheck:
    """Which of the checkpoints ``ids`` (all when ``None``) name chunks the store lacks.

    Cheap: one LIST of ``manifests/``, a GET of each manifest asked for, and one LIST of
    ``chunks/``; no chunk is read. A checkpoint asked for that no longer exists is in
    ``not_found``, not an error. The missing chunks are dropped from the local index.
    """
    checked_at = time.time()
    started = time.monotonic()
    by_id, _strays = _manifest_keys(ctx)
    wanted = sorted(by_id) if ids is None else sorted(set(ids))
    survey = _survey(ctx, [by_id[i] for i in wanted if i in by_id])
    present = list_chunk_ids(ctx)
    missing = [c for c in survey.users if c not in present]
    ctx.index.discard(missing)
    return StoreCheck(
        checked_at=checked_at,
        seconds=time.monotonic() - started,
        checkpoints=survey.checkpoints,
        missing=_damage(survey, missing),
        chunks_checked=len(survey.users),
        chunks_missing=len(missing),
        manifests_bad=survey.bad,
        not_found=[i for i in wanted if i not in by_id],
    )
