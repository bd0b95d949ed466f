"""The plan: per-kind figures, the pool, both checkpoints, and the fit in each cloud's notice.

``make_plan`` combines a model's shapes (``families``) with an engine's accounting
(``engines``); ``Plan.to_json`` is the ``--json`` document, whose key names are a contract
(``docs/planning.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpusnap.cli.plan import engines
from gpusnap.cli.plan.engines import Engine
from gpusnap.cli.plan.shapes import ATTENTION_KINDS, AttentionShape, Kind, ModelShape, StateShape
from gpusnap.cli.plan.weights import Weights
from gpusnap.errors import InvalidArgument

if TYPE_CHECKING:  # the daemon client is imported only by a plan that asks it
    from gpusnap.cli.plan.measured import Measured

GiB = engines.GiB

# The notice each cloud gives before it takes a spot machine back, in seconds
# (docs/planning.md): AWS's two-minute interruption notice;
# GCP Spot's 30 s between ACPI G2 soft-off and G3 hard-off (with no preemption notice
# period configured); Azure's Preempt scheduled event, at least 30 s before NotBefore.
CLOUD_DEADLINES: tuple[tuple[str, float], ...] = (("aws", 120.0), ("gcp", 30.0), ("azure", 30.0))

DEFAULT_CONTEXT = 32768
# Host memory of one engine process per GPU that a checkpoint captures (CRIU pages): an
# assumption unless --host-bytes says otherwise, and counted as changed in every checkpoint.
DEFAULT_HOST_BYTES = 2 * GiB


@dataclass(frozen=True)
class KindFigures:
    """One kind of layer, per GPU (a node holds ``tp`` times as much)."""

    kind: Kind
    layers: int
    kv_bytes_per_token: float  # growth per token of context once windows are full
    state_bytes_per_session: int  # at the plan's context
    entries_per_session: int | None  # attention kinds: cache entries held, all layers
    window: int | None


@dataclass(frozen=True)
class Fit:
    cloud: str
    deadline_seconds: float
    upload_seconds: float | None
    fits: bool | None


@dataclass
class Plan:
    model_path: str
    model: ModelShape
    engine: Engine
    context: int
    kinds: list[KindFigures]
    weights: Weights | None
    gpu_memory: int | None
    overhead_per_gpu: int
    pool_per_gpu: int | None
    host_bytes_per_gpu: int
    sessions: int
    sessions_capacity: int | None
    bandwidth: float | None
    bandwidth_source: str | None
    fits: list[Fit]
    notes: list[str] = field(default_factory=list)
    # --workload: the workload's real last checkpoints, which replace the estimates of both
    # checkpoints (per node; per GPU is a node's share, ``/ tp``).
    measured: Measured | None = None

    # -- figures ---------------------------------------------------------------------

    @property
    def tp(self) -> int:
        return self.engine.tp

    @property
    def kv_bytes_per_token(self) -> float:
        return sum(k.kv_bytes_per_token for k in self.kinds)

    @property
    def state_bytes_per_session(self) -> int:
        return sum(k.state_bytes_per_session for k in self.kinds)

    @property
    def weights_per_gpu(self) -> int | None:
        return None if self.weights is None else -(-self.weights.total_bytes // self.tp)

    @property
    def full_per_gpu(self) -> float | None:
        """The full checkpoint: the latest real one (``--workload``), else the estimate."""
        if self.measured is not None:
            return self.measured.latest.bytes_total / self.tp
        return self.estimated_full_per_gpu

    @property
    def reclaim_per_gpu(self) -> float:
        """The reclaim checkpoint: what the last real incremental one uploaded
        (``--workload``), else the estimate."""
        if self.measured is not None and self.measured.reclaim_bytes is not None:
            return self.measured.reclaim_bytes / self.tp
        return self.estimated_reclaim_per_gpu

    @property
    def estimated_full_per_gpu(self) -> int | None:
        """A checkpoint of the whole process: device memory (weights, the whole pool, the
        rest the engine allocated) plus its host pages."""
        if self.weights_per_gpu is None or self.pool_per_gpu is None:
            return None
        device = self.weights_per_gpu + self.pool_per_gpu + self.overhead_per_gpu
        return device + self.host_bytes_per_gpu

    @property
    def estimated_reclaim_per_gpu(self) -> int:
        """What a reclaim checkpoint uploads when the weights (and the pool's unused, unchanged
        pages) are already in the store: the live sessions' KV and state, and host pages."""
        return self.sessions * self.state_bytes_per_session + self.host_bytes_per_gpu

    def to_json(self) -> dict[str, Any]:
        tp = self.tp

        def both(per_gpu: float | None) -> dict[str, Any] | None:
            if per_gpu is None:
                return None
            return {"per_gpu": _num(per_gpu), "per_node": _num(per_gpu * tp)}

        return {
            "model": {
                "config": self.model_path,
                "model_type": self.model.model_type,
                "architectures": list(self.model.architectures),
                "dtype": self.model.dtype,
                "num_hidden_layers": len(self.model.layers),
            },
            "engine": {
                "name": self.engine.name,
                "tp": tp,
                "kv_dtype": self.engine.kv_dtype,
                "kv_bytes_per_element": self.engine.kv_bytes,
                "block_size": self.engine.block_size,
                "state_page_bytes": self.engine.state_page,
                "gpu_memory": self.gpu_memory,
                "gpu_memory_utilization": self.engine.utilization,
                "overhead_bytes_per_gpu": self.overhead_per_gpu,
            },
            "context": self.context,
            "sessions": self.sessions,
            "sessions_capacity": self.sessions_capacity,
            "layers": {k.kind.value: k.layers for k in self.kinds},
            "by_kind": [
                {
                    "kind": k.kind.value,
                    "layers": k.layers,
                    "window": k.window,
                    "entries_per_session": k.entries_per_session,
                    "kv_bytes_per_token": both(k.kv_bytes_per_token),
                    "state_bytes_per_session": both(k.state_bytes_per_session),
                }
                for k in self.kinds
            ],
            "kv_bytes_per_token": both(self.kv_bytes_per_token),
            "state_bytes_per_session": both(self.state_bytes_per_session),
            "weights_bytes": both(self.weights_per_gpu),
            "weights_source": self.weights.source if self.weights else None,
            "kv_pool_bytes": both(self.pool_per_gpu),
            "host_bytes": both(self.host_bytes_per_gpu),
            "checkpoint_bytes_full": both(self.full_per_gpu),
            "checkpoint_bytes_reclaim": both(self.reclaim_per_gpu),
            "checkpoint_bytes_source": checkpoint_bytes_source(self.measured),
            "estimated": {
                "checkpoint_bytes_full": both(self.estimated_full_per_gpu),
                "checkpoint_bytes_reclaim": both(self.estimated_reclaim_per_gpu),
            },
            "measured": self.measured.to_json() if self.measured is not None else None,
            "bandwidth_bytes_per_second": _num(self.bandwidth) if self.bandwidth else None,
            "bandwidth_source": self.bandwidth_source,
            "reclaim_fit": fits_to_json(self.fits),
            "notes": list(self.notes),
        }


def fits_to_json(fits: list[Fit]) -> dict[str, Any]:
    """``reclaim_fit`` of ``--json``: per cloud, its notice, the upload time, and the verdict."""
    return {
        f.cloud: {
            "deadline_seconds": _num(f.deadline_seconds),
            "upload_seconds": None if f.upload_seconds is None else round(f.upload_seconds, 3),
            "fits": f.fits,
        }
        for f in fits
    }


def measured_only(
    measured: Measured, bandwidth: float | None, bandwidth_source: str | None
) -> tuple[dict[str, Any], list[Fit]]:
    """The plan of ``--workload`` without ``--model``: the real checkpoints and the fit, per
    node: the ``--json`` document (its keys are those of a full plan it can fill), the fits."""
    reclaim = measured.reclaim_bytes
    fits = reclaim_fit(reclaim or 0, bandwidth, measured) if reclaim is not None else []
    notes = fit_notes(bandwidth, measured) if reclaim is not None else []
    if reclaim is None:
        notes.append(
            "the workload has no incremental checkpoint yet, and without --model nothing is "
            "estimated: reclaim checkpoint unknown"
        )
    doc = {
        "workload": measured.workload,
        "checkpoint_bytes_full": {"per_node": measured.latest.bytes_total},
        "checkpoint_bytes_reclaim": None if reclaim is None else {"per_node": reclaim},
        "checkpoint_bytes_source": checkpoint_bytes_source(measured),
        "measured": measured.to_json(),
        "bandwidth_bytes_per_second": _num(bandwidth) if bandwidth else None,
        "bandwidth_source": bandwidth_source,
        "reclaim_fit": fits_to_json(fits),
        "notes": notes,
    }
    return doc, fits


def checkpoint_bytes_source(measured: Measured | None) -> dict[str, str]:
    """Where each checkpoint figure came from: ``measured`` (a real checkpoint, named) or
    ``estimated`` (the model's shapes and the engine's accounting)."""
    if measured is None:
        return {"full": "estimated", "reclaim": "estimated"}
    inc = measured.last_incremental
    return {
        "full": f"measured: {measured.latest.checkpoint_id}",
        "reclaim": f"measured: {inc.checkpoint_id}" if inc is not None else "estimated",
    }


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(x, 3)


def kind_figures(model: ModelShape, engine: Engine, context: int) -> list[KindFigures]:
    """Per kind of layer, summed over its layers, per GPU."""
    out = []
    for kind in model.kinds():
        layers = [x for x in model.layers if x is not None and x.kind == kind]
        if kind in ATTENTION_KINDS:
            attention = [x for x in layers if isinstance(x, AttentionShape)]
            entries = [engines.entries_held(engine, x, context) for x in attention]
            state = sum(
                n * engines.token_bytes(engine, x) for n, x in zip(entries, attention, strict=True)
            )
            growth = sum(engines.growth_per_token(engine, x) for x in attention)
            out.append(
                KindFigures(kind, len(layers), growth, state, sum(entries), attention[0].window)
            )
        else:
            states = [x for x in layers if isinstance(x, StateShape)]
            state = sum(engines.session_state_bytes(engine, x) for x in states)
            out.append(KindFigures(kind, len(layers), 0.0, state, None, None))
    return out


def state_at(model: ModelShape, engine: Engine, context: int) -> dict[Kind, int]:
    """State bytes per session per kind at ``context`` (per GPU): the plot's curves."""
    return {k.kind: k.state_bytes_per_session for k in kind_figures(model, engine, context)}


def make_plan(
    *,
    model_path: str,
    model: ModelShape,
    engine: Engine,
    context: int | None,
    sessions: int | None,
    weights: Weights | None,
    gpu_memory: int | None,
    overhead: int | None,
    host_bytes: int | None,
    bandwidth: float | None,
    bandwidth_source: str | None,
    measured: Measured | None = None,
) -> Plan:
    notes: list[str] = []
    if context is None:
        context = min(DEFAULT_CONTEXT, model.max_position_embeddings or DEFAULT_CONTEXT)
        notes.append(f"context {context} tokens (default: pass --context)")
    if context < 1:
        raise InvalidArgument("--context must be at least 1 token")
    if model.max_position_embeddings and context > model.max_position_embeddings:
        notes.append(
            f"context {context} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings}"
        )
    kinds = kind_figures(model, engine, context)
    per_session = sum(k.state_bytes_per_session for k in kinds)
    tp = engine.tp
    if overhead is None:
        overhead = engines.overhead_bytes(engine, model)
        notes.append("overhead beside weights and pool is modelled, not measured (--overhead)")
    pool: int | None = None
    if weights is None:
        notes.append("no safetensors index: weights, pool and full checkpoint not sized")
    if gpu_memory is None:
        notes.append("no --gpu-memory: pool and full checkpoint not sized")
    if weights is not None and gpu_memory is not None:
        pool = engines.pool_bytes(engine, gpu_memory, -(-weights.total_bytes // tp), overhead)
    capacity = pool // per_session if pool is not None and per_session else None
    if sessions is None:
        sessions = capacity if capacity else 1
        notes.append(
            f"{sessions} live session(s) of {context} tokens "
            + ("(the pool full; pass --sessions)" if capacity else "(pass --sessions)")
        )
    elif capacity is not None and sessions > capacity:
        notes.append(f"{sessions} sessions of {context} tokens do not fit the pool ({capacity} do)")
    if host_bytes is None:
        host_bytes = DEFAULT_HOST_BYTES
        notes.append("host pages per GPU process assumed 2 GiB, all changed (--host-bytes)")
    plan = Plan(
        model_path=model_path,
        model=model,
        engine=engine,
        context=context,
        kinds=kinds,
        weights=weights,
        gpu_memory=gpu_memory,
        overhead_per_gpu=overhead,
        pool_per_gpu=pool,
        host_bytes_per_gpu=host_bytes,
        sessions=sessions,
        sessions_capacity=capacity,
        bandwidth=bandwidth,
        bandwidth_source=bandwidth_source,
        fits=[],
        notes=notes,
        measured=measured,
    )
    plan.fits = reclaim_fit(plan.reclaim_per_gpu * tp, bandwidth, measured)
    notes.extend(fit_notes(bandwidth, measured))
    return plan


def reclaim_fit(
    node_bytes: float, bandwidth: float | None, measured: Measured | None = None
) -> list[Fit]:
    """Upload seconds of the node's reclaim checkpoint against each cloud's notice: at the
    bandwidth given or measured, else (``--workload``) the last incremental push's own time."""
    seconds: float | None = None
    if bandwidth:
        seconds = node_bytes / bandwidth
    elif measured is not None and measured.last_incremental is not None:
        seconds = measured.last_incremental.upload_seconds
    return [
        Fit(cloud, deadline, seconds, None if seconds is None else seconds <= deadline)
        for cloud, deadline in CLOUD_DEADLINES
    ]


def fit_notes(bandwidth: float | None, measured: Measured | None) -> list[str]:
    """What the fit rests on, said where it is not a bandwidth given or measured."""
    if bandwidth:
        return []
    if measured is not None and measured.last_incremental is not None:
        return [
            f"upload time: the last incremental checkpoint's own push "
            f"({measured.last_incremental.checkpoint_id})"
        ]
    if measured is not None:
        return ["the workload has no incremental checkpoint yet: reclaim checkpoint estimated"]
    return ["no --bandwidth or --store: upload time not estimated"]
