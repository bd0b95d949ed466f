"""Triggers and migration for a container workload: a reclaim (drilled) checkpoints the
configured container on node A, and the standby node B claims the published checkpoint and
restores the container into its own podman storage — real daemons, podman, CRIU and CLI."""

from __future__ import annotations

from pathlib import Path

from tests.containers.daemons import Daemons, cli_json, podman_section, start_daemon
from tests.containers.harness import (
    Node,
    genloop_spec,
    new_loop,
    removing,
    started,
    wait_done,
    wait_lines,
)
from tests.e2e_reclaim import ask

STEPS = 300


def _node_config(node: Node, container: str, *, standby: bool) -> str:
    return (
        podman_section(node)
        + f'[[workload]]\nname = "llm"\ncontainer = "{container}"\nruntime = "podman"\n'
        + 'on_notice = "checkpoint"\n'
        + '[triggers]\nprovider = "none"\nlogind = false\n'
        + f"[migration]\nstandby = {'true' if standby else 'false'}\npoll_interval = 0.2\n"
    )


def test_a_reclaim_checkpoints_the_container_workload_and_the_standby_restores_it(
    node_a: Node, node_b: Node, daemons: Daemons, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "dreclaim", STEPS)
    a = start_daemon(daemons, "a", _node_config(node_a, name, standby=False))
    b = start_daemon(daemons, "b", _node_config(node_b, name, standby=True))
    with (
        started(node_a.podman, genloop_spec(node_a, out, steps=STEPS), name),
        removing(node_b.podman, name),
    ):
        wait_lines(out, 30)
        drill = cli_json(a, "drill", "reclaim", "--deadline", "60")
        assert drill["workload"] == "llm"
        job = ask.committed_reclaim(a)
        assert job["trigger"] == "drill" and job["result"]["leave_running"] is False
        assert job["result"]["container"]["name"] == name
        assert job["result"]["committed_before_deadline"] is True

        done = ask.finished_migration(b)
        assert done["checkpoint_id"] == job["result"]["checkpoint_id"]
        assert done["claim"]["node_id"] == "b" and done["outcome"]["mode"] == "restored", done
        restore = cli_json(b, "job", done["outcome"]["job_id"])
        assert restore["result"]["container"]["name"] == name
        assert node_b.podman.inspect(name).running
        assert wait_done(out) == expected
