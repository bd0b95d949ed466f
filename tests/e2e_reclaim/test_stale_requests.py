"""Migration requests no standby may adopt any more, on real daemons over a moto S3 store: one
older than ``[migration] request_ttl``, one an operator withdrew (``gpusnap migrations
withdraw``), one whose workload was restored elsewhere meanwhile. A standby that joins later
looks at the board, twice, and starts nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_reclaim import ask
from tests.e2e_reclaim.cluster import WORKLOAD, Cluster, ReclaimWorkload
from tests.support.daemons import Node
from tests.support.waits import wait_for

pytestmark = [pytest.mark.criu, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(300)]


def _reclaimed(cluster: Cluster, workload: ReclaimWorkload) -> tuple[Node, str]:
    """Node ``a`` drills a reclaim: the workload checkpointed in kill mode and published."""
    a = cluster.reclaimed(workload)
    workload.reap_when_killed()
    drill = a.cli("drill", "reclaim", "--deadline", "60", "--json")
    assert drill.rc == 0, drill.stderr
    cid: str = ask.committed_reclaim(a)["result"]["checkpoint_id"]
    return a, cid


def _looks_and_leaves_it(standby: Node, cid: str) -> dict[str, Any]:
    """The standby has looked at the board twice (every pending request considered each
    time) and started nothing; its view of the migration."""
    wait_for(
        "the standby's second look at the board",
        lambda: ask.cli_json(standby, "triggers")["standby"]["looks"] >= 2,
    )
    assert ask.jobs(standby, "restore") == []
    (seen,) = ask.migrations(standby)
    assert seen["checkpoint_id"] == cid
    claim = seen["claim"]
    assert claim is None or claim["node_id"] != standby.name
    return seen


def test_a_standby_that_joins_after_the_request_expired_starts_no_stale_copy(
    cluster: Cluster, workload: ReclaimWorkload
) -> None:
    ttl = 2.0
    _, cid = _reclaimed(cluster, workload)
    (request,) = [m["request"] for m in ask.migrations(cluster.nodes.items[0])]
    wait_for("the request to pass its ttl", lambda: time.time() > request["created_at"] + ttl)
    b = cluster.standby("b", workload, request_ttl=ttl)
    seen = _looks_and_leaves_it(b, cid)
    assert seen["status"] == "expired"
    assert seen["expires_at"] == pytest.approx(request["created_at"] + ttl)
    assert [k for k in cluster.keys(f"migrations/{cid}/") if "/claim-" in k] == []
    shown = b.cli("migrations")
    assert "expired" in shown.stdout and cid in shown.stdout


def test_a_withdrawn_request_is_not_adopted_and_says_why(
    cluster: Cluster, workload: ReclaimWorkload
) -> None:
    a, cid = _reclaimed(cluster, workload)
    done = a.cli("migrations", "withdraw", cid, "--reason", "moved to the new cluster by hand")
    assert done.rc == 0, done.stderr
    assert done.stdout == f"migration of {cid} ({WORKLOAD}) withdrawn: no standby adopts it\n"
    again = a.cli("migrations", "withdraw", cid)
    assert again.rc == 1
    assert again.stderr.strip().endswith(
        "is withdrawn by a: only a request no node has claimed can be withdrawn"
    ), again.stderr
    assert len(again.stderr.strip().splitlines()) == 1

    b = cluster.standby("b", workload)
    seen = _looks_and_leaves_it(b, cid)
    assert seen["status"] == "withdrawn"
    assert seen["outcome"]["detail"] == "moved to the new cluster by hand"
    assert "withdrawn: moved to the new cluster by hand" in b.cli("migrations").stdout


def test_a_workload_restored_elsewhere_supersedes_its_pending_request(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    _, cid = _reclaimed(cluster, workload)
    c = cluster.standby("c", workload, standby=False)  # an operator restores it here
    restored = c.cli("restore", cid, "--wait", "--json")
    assert restored.rc == 0, restored.stderr
    workload.check_continues_identically(tmp_path)
    (seen_from_c,) = ask.migrations(c)
    assert seen_from_c["status"] == "superseded"
    assert seen_from_c["outcome"]["detail"] == (
        f"{WORKLOAD} was restored on c by job {restored.json['job_id']}"
    )

    b = cluster.standby("b", workload)
    assert _looks_and_leaves_it(b, cid)["status"] == "superseded"
