"""The plan as a person reads it: a few sections of aligned figures (``--json`` has them all)."""

from __future__ import annotations

from gpusnap.cli._output import human_bytes, render_table
from gpusnap.cli.plan.estimate import Plan


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
    if plan.bandwidth:
        bw = f"at {human_bytes(plan.bandwidth)}/s ({plan.bandwidth_source})"
    else:
        bw = "no bandwidth given"
    fits = render_table(
        ["cloud", "notice", "upload", "fits"],
        [
            [
                f.cloud,
                f"{f.deadline_seconds:.0f} s",
                "-" if f.upload_seconds is None else f"{f.upload_seconds:.1f} s",
                "-" if f.fits is None else ("yes" if f.fits else "NO"),
            ]
            for f in plan.fits
        ],
    )
    capacity = (
        ""
        if plan.sessions_capacity is None
        else f"\nthe pool holds {plan.sessions_capacity} session(s) of {plan.context} tokens"
    )
    notes = "".join(f"\nnote: {n}" for n in plan.notes)
    return f"{head}\n\n{kinds}\n\n{sizes}{capacity}\n\nreclaim checkpoint {bw}:\n{fits}{notes}\n"
