"""The plan as a person reads it: a few sections of aligned figures (``--json`` has them all)."""

from __future__ import annotations

from typing import Any

from gpusnap.cli._output import human_bytes, render_table
from gpusnap.cli.plan.estimate import Fit, Plan
from gpusnap.cli.plan.measured import Measured, Pushed


def _b(n: float | None) -> str:
    return "-" if n is None else human_bytes(n)


def _pair(per_gpu: float | None, tp: int) -> list[str]:
    return [_b(per_gpu), _b(None if per_gpu is None else per_gpu * tp)]


def render(plan: Plan) -> str:
    tp = plan.tp
    e = plan.engine
    head = (
        f"{plan.model.model_type} ({', '.join(plan.model.architectures) or 'no architectures'}), "
        f"{len(plan.model.layers)} layers, {plan.model.dtype}\n"
        f"{e.name}: tp {tp}, kv {e.kv_dtype} ({e.kv_bytes} B/element), block {e.block_size} "
        f"tokens, context {plan.context} tokens, {plan.sessions} session(s)"
    )
    kind_rows = [
        [
            k.kind.value,
            str(k.layers),
            "-" if k.window is None else str(k.window),
            *_pair(k.kv_bytes_per_token, tp),
            *_pair(k.state_bytes_per_session, tp),
        ]
        for k in plan.kinds
    ]
    kind_rows.append(
        [
            "total",
            str(sum(k.layers for k in plan.kinds)),
            "",
            *_pair(plan.kv_bytes_per_token, tp),
            *_pair(plan.state_bytes_per_session, tp),
        ]
    )
    kinds = render_table(
        [
            "kind",
            "layers",
            "window",
            "kv/token gpu",
            "kv/token node",
            "session gpu",
            "session node",
        ],
        kind_rows,
    )
    sizes = render_table(
        ["", "per gpu", "per node"],
        [
            ["weights", *_pair(plan.weights_per_gpu, tp)],
            ["kv pool", *_pair(plan.pool_per_gpu, tp)],
            ["checkpoint (full)", *_pair(plan.full_per_gpu, tp)],
            ["checkpoint (reclaim)", *_pair(plan.reclaim_per_gpu, tp)],
        ],
    )
    measured = "" if plan.measured is None else "\n\n" + render_measured(plan.measured)
    capacity = (
        ""
        if plan.sessions_capacity is None
        else f"\nthe pool holds {plan.sessions_capacity} session(s) of {plan.context} tokens"
    )
    fits = render_fits(plan.fits, plan.bandwidth, plan.bandwidth_source)
    notes = "".join(f"\nnote: {n}" for n in plan.notes)
    return f"{head}\n\n{kinds}\n\n{sizes}{capacity}{measured}\n\n{fits}{notes}\n"


def render_fits(fits: list[Fit], bandwidth: float | None, source: str | None) -> str:
    if bandwidth:
        bw = f"at {human_bytes(bandwidth)}/s ({source})"
    elif fits and fits[0].upload_seconds is not None:
        bw = "at the speed of the last incremental checkpoint's push"
    else:
        bw = "no bandwidth given"
    table = render_table(
        ["cloud", "notice", "upload", "fits"],
        [
            [
                f.cloud,
                f"{f.deadline_seconds:.0f} s",
                "-" if f.upload_seconds is None else f"{f.upload_seconds:.1f} s",
                "-" if f.fits is None else ("yes" if f.fits else "NO"),
            ]
            for f in fits
        ],
    )
    return f"reclaim checkpoint {bw}:\n{table}"


def _pushed_row(what: str, p: Pushed | None) -> list[str]:
    if p is None:
        return [what, "-", "-", "-", "-"]
    took = "-" if p.upload_seconds is None else f"{p.upload_seconds:.2f} s"
    return [what, p.checkpoint_id, _b(p.bytes_total), _b(p.bytes_uploaded), took]


def render_measured(m: Measured) -> str:
    """The workload's real checkpoints (``--workload``), per node."""
    parts = render_table(
        ["", "bytes"],
        [
            *[[f"gpu memory {path}", _b(n)] for path, n in m.gpu_memory_streams],
            ["gpu memory (all)", _b(m.gpu_memory_bytes)],
            ["page images", _b(m.page_image_bytes)],
            ["other host files", _b(m.other_host_bytes)],
        ],
    )
    pushes = render_table(
        ["checkpoint", "id", "size", "uploaded", "upload"],
        [
            _pushed_row("latest", m.latest),
            _pushed_row("last incremental", m.last_incremental),
            _pushed_row("last full", m.last_full),
        ],
    )
    return (
        f"workload {m.workload}: {m.checkpoints} checkpoint(s) in the store; the latest holds "
        f"(per node):\n{parts}\n{pushes}"
    )


def render_measured_only(doc: dict[str, Any], m: Measured, fits: list[Fit]) -> str:
    """``--workload`` without ``--model``: the real checkpoints and the fit."""
    notes = "".join(f"\nnote: {n}" for n in doc["notes"])
    return (
        f"{render_measured(m)}\n\n"
        f"{render_fits(fits, doc['bandwidth_bytes_per_second'], doc['bandwidth_source'])}"
        f"{notes}\n"
    )
