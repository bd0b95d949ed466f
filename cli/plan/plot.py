"""``--plot``: state bytes per session against context length, one curve per kind of layer,
with each cloud's reclaim window drawn as the per-session budget it leaves.

matplotlib is an optional extra (``pip install gpusnap[plot]``); it is imported here only,
and only when a plot is asked for, with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path

from gpusnap.cli.plan.estimate import Plan, state_at
from gpusnap.errors import FailedPrecondition, InvalidArgument

_POINTS = 48


def _contexts(top: int) -> list[int]:
    """Context lengths from 1 token to ``top``, evenly spaced on a log axis."""
    top = max(top, 2)
    points = sorted({max(1, round(top ** (i / (_POINTS - 1)))) for i in range(_POINTS)})
    return points if points[-1] == top else [*points, top]


def draw(plan: Plan, out: Path) -> None:
    """Write a PNG of ``plan``'s per-session state (per GPU) to ``out``."""
    try:
        import matplotlib  # noqa: PLC0415 - an optional extra, only for --plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise FailedPrecondition("--plot needs matplotlib: pip install 'gpusnap[plot]'") from exc
    top = max(plan.context, plan.model.max_position_embeddings or 0)
    xs = _contexts(top)
    curves = [state_at(plan.model, plan.engine, x) for x in xs]
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    try:
        for kind in plan.model.kinds():
            ax.plot(
                xs,
                [max(c[kind], 1) for c in curves],
                label=f"{kind.value} ({plan.model.count(kind)} layers)",
            )
        ax.plot(xs, [max(sum(c.values()), 1) for c in curves], "k-", linewidth=2, label="total")
        if plan.bandwidth:
            # Clouds with the same notice share one line (GCP and Azure: 30 s).
            deadlines: dict[float, list[str]] = {}
            for fit in plan.fits:
                deadlines.setdefault(fit.deadline_seconds, []).append(fit.cloud)
            for (deadline, clouds), color in zip(
                deadlines.items(), ("tab:red", "tab:purple", "tab:brown"), strict=False
            ):
                # Bytes each live session may hold for the reclaim checkpoint to upload in time.
                node_budget = plan.bandwidth * deadline
                budget = (node_budget / plan.tp - plan.host_bytes_per_gpu) / plan.sessions
                if budget > 0:
                    ax.axhline(
                        budget,
                        color=color,
                        linestyle="--",
                        linewidth=1.2,
                        label=f"{', '.join(clouds)}: {deadline:.0f} s notice",
                    )
        ax.axvline(plan.context, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("state bytes per session, per GPU")
        ax.set_title(
            f"{plan.model.model_type} on {plan.engine.name}, tp {plan.tp}, "
            f"{plan.sessions} session(s), kv {plan.engine.kv_dtype}"
        )
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="small")
        try:
            fig.savefig(out, format="png")
        except OSError as exc:
            raise InvalidArgument(f"cannot write {out}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
