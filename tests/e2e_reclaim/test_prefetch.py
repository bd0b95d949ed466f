"""A warm standby: node B prefetches node A's checkpoint into its chunk cache, A's process
changes 5% of its memory and is checkpointed again (kill mode, as a reclaim does), and B
restores the new checkpoint fetching from the store only what changed — real gpusnapd
daemons, the real CLI, real CRIU on a real process, a moto S3 store over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_reclaim import ask
from tests.e2e_reclaim.cluster import Cluster, cluster_of, triggers_section
from tests.support.daemons import HANG_GUARD
from tests.support.holder import Holder
from tests.support.moto_server import MotoServer
from tests.support.waits import wait_for

pytestmark = [pytest.mark.criu, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(600)]

# Large enough that the chunks around the change and the interpreter's own pages that change
# (a few chunks of ~2 MiB, whatever the size) stay well inside the 10% beside the 5%.
HOLDER_MIB = 384
NAME = "holder"


@pytest.fixture
def holder_and_cluster(
    tmp_path: Path, moto_server: MotoServer, s3_bucket: str
) -> Iterator[tuple[Holder, Cluster]]:
    """The holder, and nodes over ``s3_bucket``; the nodes stop first, then whatever runs of
    the holder is killed."""
    holder = Holder(tmp_path / "run", HOLDER_MIB)
    try:
        with cluster_of(tmp_path, moto_server, s3_bucket) as cluster:
            yield holder, cluster
    finally:
        holder.kill_whatever_runs()


def _workload(pid_file: Path | None = None) -> str:
    """The workload's table; a standby declares it without a pid file (it does not run there)."""
    finder = f'pid_file = "{pid_file}"\n' if pid_file is not None else ""
    return f'\n[[workload]]\nname = "{NAME}"\n{finder}on_notice = "none"\n'


def _warm(node_status: dict[str, Any]) -> dict[str, Any] | None:
    (mine,) = [w for w in node_status["workloads"] if w["name"] == NAME]
    warm: dict[str, Any] | None = mine["warm"]
    return warm


def test_a_standby_that_prefetched_restores_a_5_percent_change_fetching_under_10_percent(
    holder_and_cluster: tuple[Holder, Cluster],
) -> None:
    holder, cluster = holder_and_cluster
    a = cluster.node("a", triggers_section("none") + _workload(holder.pid_file))
    first = ask.cli_json(a, "checkpoint", "--workload", NAME, "--leave-running", "--wait")
    cp1 = first["checkpoint_id"]

    # B starts after the first checkpoint, and looks at the store again only in an hour:
    # its first look prefetches cp1, so what its restore fetches below is exactly the delta.
    b = cluster.node(
        "b",
        triggers_section("none")
        + "[migration]\nstandby = true\npoll_interval = 3600\nprefetch = true\n"
        + f"prefetch_bandwidth = {json.dumps(200e6)}\n"  # every [[workload]]: this one
        + "[cache]\nmax_bytes = 4294967296\n"
        + _workload(),
    )

    def warm_on_b() -> dict[str, Any] | None:
        warm = _warm(ask.cli_json(b, "status"))
        return warm if warm is not None and warm["fraction"] == 1.0 else None

    warm = wait_for("B to hold all of the first checkpoint", warm_on_b)
    assert warm["checkpoint_id"] == cp1 and warm["bytes_warm"] == warm["bytes_total"] > 0
    prefetch = ask.cli_json(b, "triggers")["prefetch"]
    assert prefetch["enabled"] is True
    (followed,) = prefetch["workloads"]
    assert (followed["workload"], followed["checkpoint_id"]) == (NAME, cp1)
    assert followed["bytes_fetched"] > 0 and followed["warm_fraction"] == 1.0
    # A seeded its own cache with what it pushed: it too holds the whole checkpoint.
    assert _warm(ask.cli_json(a, "status")) == {**warm}

    holder.change()  # 5% of its memory, one contiguous run of random bytes
    digest = holder.digest()
    second = ask.cli_json(a, "checkpoint", "--workload", NAME, "--wait")  # kill mode
    cp2 = second["checkpoint_id"]
    assert second["parent"] == cp1
    holder.proc.wait(HANG_GUARD)  # the dump killed it: its pid is free for the restore

    result = ask.cli_json(b, "restore", cp2, "--wait")  # the job's result, as --json gives it
    assert result["mode"] == "restored", result
    total, fetched, cached = result["bytes_total"], result["bytes_fetched"], result["bytes_cached"]
    assert 0 < fetched <= 0.10 * total, result
    # The rest came from B's cache (objects are compressed, so a little under the total).
    assert cached >= 0.5 * total, result
    assert result["pids"][0] == holder.pid
    assert holder.digest() == digest  # the restored process holds the changed memory
    job = ask.cli_json(b, "job", result["job_id"])["result"]
    assert (job["bytes_fetched"], job["bytes_cached"]) == (fetched, cached)
    (row,) = [line for line in b.cli("status").stdout.splitlines() if line.startswith(NAME)]
    assert row.split()[1] == cp2  # and how much of it is warm here, now all of it
    assert row.split()[-4] == "100%", row


def test_the_restore_result_and_json_carry_bytes_fetched_and_bytes_cached_when_cold(
    holder_and_cluster: tuple[Holder, Cluster],
) -> None:
    holder, cluster = holder_and_cluster
    """Without prefetch B fetches the whole checkpoint; A, which pushed it, holds it all."""
    a = cluster.node("a", triggers_section("none") + _workload(holder.pid_file))
    b = cluster.node("b", triggers_section("none") + _workload())
    cp = ask.cli_json(a, "checkpoint", "--workload", NAME, "--wait")["checkpoint_id"]
    holder.proc.wait(HANG_GUARD)
    status_b = ask.cli_json(b, "status")
    assert status_b["capabilities"]["cache"].startswith(f"{b.state_dir / 'cache'}, budget ")
    cold = _warm(status_b)
    assert cold is not None and (cold["checkpoint_id"], cold["bytes_warm"]) == (cp, 0)
    assert _warm(ask.cli_json(a, "status")) == {
        **cold,
        "bytes_warm": cold["bytes_total"],
        "fraction": 1.0,
    }
    result = ask.cli_json(b, "restore", cp, "--wait")
    assert result["mode"] == "restored"
    assert result["bytes_cached"] == 0 and result["bytes_fetched"] > 0.5 * result["bytes_total"]
    # What B just fetched it keeps: it is warm now.
    assert _warm(ask.cli_json(b, "status")) == {
        **cold,
        "bytes_warm": cold["bytes_total"],
        "fraction": 1.0,
    }
