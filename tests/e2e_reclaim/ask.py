"""What the reclaim test nodes say, asked through the real ``gpusnap`` CLI (``--json``)."""

from __future__ import annotations

from typing import Any

from tests.support.daemons import Node
from tests.support.waits import wait_for


def cli_json(node: Node, *args: str) -> Any:
    res = node.cli(*args, "--json")
    assert res.rc == 0, f"gpusnap {' '.join(args)} on {node.name}: {res.stderr}\n{node.log()}"
    return res.json


def jobs(node: Node, kind: str | None = None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cli_json(node, "jobs")["jobs"]
    return [j for j in items if kind is None or j["kind"] == kind]


def reclaim_jobs(node: Node) -> list[dict[str, Any]]:
    return [
        j
        for j in jobs(node, "checkpoint")
        if j["trigger"].split(":")[0] in ("reclaim", "drill", "maintenance", "shutdown")
    ]


def migrations(node: Node) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cli_json(node, "migrations")["migrations"]
    return items


def finished_migration(node: Node) -> dict[str, Any]:
    """Wait for the one migration to have an outcome; return it (``gpusnap migrations``)."""

    def probe() -> dict[str, Any] | None:
        items = migrations(node)
        done = [m for m in items if m["outcome"] is not None]
        return done[0] if done else None

    try:
        return wait_for("a migration outcome", probe)
    except TimeoutError as exc:
        # What the board and the node said, so that a hang seen once can be diagnosed.
        raise AssertionError(
            f"{exc}\nmigrations: {migrations(node)}\njobs: {jobs(node)}\n"
            f"triggers: {cli_json(node, 'triggers').get('standby')}\n"
            f"log of {node.name}:\n{node.log()}"
        ) from exc


def committed_reclaim(node: Node) -> dict[str, Any]:
    """Wait for the node's reclaim checkpoint job to end; return it."""

    def probe() -> dict[str, Any] | None:
        done = [j for j in reclaim_jobs(node) if j["state"] in ("succeeded", "failed", "cancelled")]
        return done[0] if done else None

    job = wait_for("the reclaim checkpoint to end", probe)
    assert job["state"] == "succeeded", f"{job}\n{node.log()}"
    return job
