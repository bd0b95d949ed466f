"""``gpusnap triggers``, ``gpusnap migrations`` and ``gpusnap drill reclaim``.

``triggers`` shows the reclaim watchers (provider, last poll, last error, last notice) and
each workload's policy state; ``migrations`` shows migration requests (pending, claimed by
whom, outcome, expired or superseded) and ``migrations withdraw ID`` ends one no node took;
``drill reclaim`` runs the whole reclaim path on this node as if a notice had arrived — the
workloads are checkpointed in kill mode and published for standby nodes. All take ``--json``;
a daemon that cannot be reached is one line and exit 5.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from gpusnap.cli._client import query
from gpusnap.cli._common import (
    Subparsers,
    add_command,
    checked_seconds,
    common_parser,
    parse_duration,
)
from gpusnap.cli._output import PROG, render_table


def _ago(epoch: object) -> str:
    if not isinstance(epoch, int | float) or not epoch:
        return "-"
    delta = time.time() - float(epoch)
    return f"{delta:.0f}s ago" if delta >= 0 else f"in {-delta:.0f}s"


def deadline_seconds(text: str) -> float:
    """``30`` (seconds) or a duration such as ``90s``, ``2m``; must be > 0."""
    try:
        value = checked_seconds(float(text), text)
    except ValueError:  # not a number (nan and inf are refused by checked_seconds)
        value = parse_duration(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"deadline must be more than 0 seconds, not {text!r}")
    return value


def render_triggers(state: dict[str, Any]) -> str:
    """Watchers, then each workload: its pid when it runs (``-``: not running), its policy,
    the background checkpoint job in flight (``JOB``: periodic, rebalance) and its reclaim."""
    lines = [f"provider: {state.get('provider', 'none')}  ({state.get('detail') or 'no detail'})"]
    rows = []
    for w in state.get("watchers") or []:
        notice = w.get("last_notice") or {}
        rows.append(
            [
                str(w.get("name", "?")),
                _ago(w.get("last_poll_at")),
                "ok" if w.get("last_poll_ok") else (w.get("last_error") or "never polled"),
                f"{notice.get('kind')} {notice.get('event_id')}" if notice else "-",
            ]
        )
    if rows:
        lines.append(render_table(["WATCHER", "LAST POLL", "STATUS", "LAST NOTICE"], rows))
    logind = state.get("logind") or {}
    if logind:
        held = "held" if logind.get("held") else f"not held ({logind.get('error') or 'released'})"
        lines.append(f"logind shutdown delay lock: {held}")
    wrows = []
    for w in state.get("workloads") or []:
        reclaim = w.get("reclaim") or {}
        wrows.append(
            [
                str(w.get("workload")),
                str(w.get("pid") or "-"),
                str(w.get("on_notice")),
                str(w.get("checkpoint_interval") or "-"),
                str(w.get("running") or "-"),
                (
                    f"{reclaim.get('trigger')} "
                    + (
                        "committed"
                        if reclaim.get("committed")
                        else "running"
                        if not reclaim.get("done")
                        else "failed"
                    )
                )
                if reclaim
                else "-",
            ]
        )
    if wrows:
        lines.append(
            render_table(["WORKLOAD", "PID", "ON NOTICE", "INTERVAL", "JOB", "RECLAIM"], wrows)
        )
    return "\n".join(lines)


def render_migrations(items: list[dict[str, Any]]) -> str:
    if not items:
        return "no migrations"
    rows = []
    for m in items:
        req = m.get("request") or {}
        claim = m.get("claim") or {}
        rows.append(
            [
                str(m.get("checkpoint_id")),
                str(req.get("workload", "?")),
                str(req.get("source_node", "?")),
                str(m.get("status")),
                f"{claim.get('node_id')} ({claim.get('mode')})" if claim else "-",
                _outcome_text(m),
            ]
        )
    return render_table(["CHECKPOINT", "WORKLOAD", "FROM", "STATUS", "CLAIMED BY", "OUTCOME"], rows)


def _outcome_text(m: dict[str, Any]) -> str:
    outcome = m.get("outcome") or {}
    if outcome:
        what = str(outcome.get("mode") or outcome.get("state") or "-")
        detail = outcome.get("detail")
        return f"{what}: {detail}" if detail and what in ("withdrawn", "superseded") else what
    if m.get("superseded_by"):
        return f"superseded by {m['superseded_by']}"
    if m.get("status") == "expired" and m.get("expires_at"):
        return f"expired {_ago(m['expires_at'])}"
    if m.get("status") == "pending" and m.get("expires_at"):
        return f"expires {_ago(m['expires_at'])}"
    return "-"


def cmd_triggers(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.triggers_status(), render_triggers)


def cmd_migrations(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.migrations(), render_migrations, key="migrations")


def cmd_migrations_withdraw(args: argparse.Namespace) -> int:
    def said(m: dict[str, Any]) -> str:
        workload = (m.get("request") or {}).get("workload", "?")
        return f"migration of {m.get('checkpoint_id')} ({workload}) withdrawn: no standby adopts it"

    return query(args, lambda c: c.withdraw_migration(args.checkpoint_id, args.reason), said)


def cmd_drill_reclaim(args: argparse.Namespace) -> int:
    def started(job: dict[str, Any]) -> str:
        return (
            f"drill: reclaim checkpoint job {job['id']} of {job['workload']} started "
            f"(deadline in {args.deadline or 120:g} s); follow it with `{PROG} job {job['id']}`"
        )

    return query(args, lambda c: c.drill(args.deadline), started)


def register(subparsers: Subparsers) -> None:
    what = "reclaim watchers: provider, last poll, last notice"
    add_command(subparsers, "triggers", cmd_triggers, what)
    what = "migration requests: pending, claimed by whom, outcome; withdraw one"
    p = add_command(subparsers, "migrations", cmd_migrations, what)
    actions = p.add_subparsers(dest="migrations_action", metavar="[withdraw]")
    what = "end a request no node has claimed: no standby adopts it after this"
    w = add_command(actions, "withdraw", cmd_migrations_withdraw, what)
    w.add_argument("checkpoint_id", metavar="ID", help="the checkpoint the request is for")
    w.add_argument("--reason", default="", help="said in the request's outcome")

    p = subparsers.add_parser(
        "drill", parents=[common_parser()], help="rehearse a reclaim on this node"
    )
    drills = p.add_subparsers(dest="drill", metavar="<drill>", required=True)
    what = "checkpoint (kill mode) and publish every workload as if a notice had arrived"
    d = add_command(drills, "reclaim", cmd_drill_reclaim, what)
    d.add_argument(
        "--deadline",
        type=deadline_seconds,
        default=None,
        metavar="SECONDS",
        help="seconds until the pretend reclaim (e.g. 30, 90s, 2m; default 120)",
    )
