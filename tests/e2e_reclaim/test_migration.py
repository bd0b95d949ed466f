"""A cloud reclaims node A; A checkpoints before the deadline and publishes; a standby node
adopts the workload exactly once — real daemons, real CRIU, a moto S3 store over HTTP."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node
from tests.e2e_reclaim.conftest import (
    POLL,
    WORKLOAD,
    Cluster,
    ReclaimWorkload,
    cli_json,
    committed_reclaim,
    finished_migration,
    jobs,
    migration_section,
    reclaim_jobs,
    triggers_section,
    wait_for,
    workload_section,
)
from tests.support.metadata_servers import (
    AwsImdsServer,
    AzureEventsServer,
    GcpMetadataServer,
    MetadataServer,
    Recorded,
)

pytestmark = [pytest.mark.criu, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(300)]


class ApprovalWitness(AzureEventsServer):
    """Scheduled Events that note, at each approval POST, which store keys already exist."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__()
        self.cluster = cluster
        self.keys_at_approval: list[list[str]] = []

    def respond(self, rec: Recorded) -> tuple[int, bytes, dict[str, str]]:
        if rec.method == "POST":
            self.keys_at_approval.append(self.cluster.keys())
        return super().respond(rec)


def _server(provider: str, cluster: Cluster) -> MetadataServer:
    if provider == "aws":
        return AwsImdsServer()
    if provider == "gcp":
        return GcpMetadataServer()
    return ApprovalWitness(cluster)


def _announce(server: MetadataServer) -> float | None:
    """Announce a reclaim; the deadline it carries (None: the daemon's default applies)."""
    if isinstance(server, AwsImdsServer):
        return server.announce_reclaim("terminate", at=time.time() + 120)
    if isinstance(server, GcpMetadataServer):
        server.preempt()
        return None
    assert isinstance(server, AzureEventsServer)
    server.schedule("Preempt", not_before=time.time() + 60)
    return None


def _standby(cluster: Cluster, name: str, wl: ReclaimWorkload, **kw: Any) -> Node:
    revision = kw.pop("revision", "r1")
    marker = kw.pop("marker", None)
    return cluster.node(
        name,
        triggers_section("none")
        + migration_section(standby=True, **kw)
        + workload_section(wl.pid_file, revision=revision, marker=marker),
    )


def _reclaimed_node(cluster: Cluster, wl: ReclaimWorkload, provider: str, url: str) -> Node:
    return cluster.node(
        "a",
        triggers_section(provider, url)
        + migration_section(standby=False)
        + workload_section(wl.pid_file),
    )


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_reclaim_notice_checkpoints_before_the_deadline_and_the_standby_continues_it(
    provider: str, cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    with _server(provider, cluster) as server:
        b = _standby(cluster, "b", workload)
        a = _reclaimed_node(cluster, workload, provider, server.url)
        workload.reap_when_killed()
        given_deadline = _announce(server)

        job = committed_reclaim(a)
        assert job["trigger"] == f"reclaim:{provider}"
        assert job["result"]["leave_running"] is False
        assert job["result"]["committed_before_deadline"] is True
        if given_deadline is not None:  # AWS: the notice's own time is the deadline
            assert job["deadline"] == pytest.approx(given_deadline, abs=1)
        cid = job["result"]["checkpoint_id"]

        done = finished_migration(b)
        assert done["checkpoint_id"] == cid
        assert done["status"] == "restored"
        assert done["request"]["source_node"] == "a"
        assert done["claim"]["node_id"] == "b"
        assert done["claim"]["mode"] == "restore"
        assert done["outcome"]["mode"] == "restored", done
        restore = cli_json(b, "job", done["outcome"]["job_id"])
        assert restore["result"]["pids"][0] == workload.pid
        workload.check_continues_identically(tmp_path)

        # What an operator sees on each node.
        state = cli_json(a, "triggers")
        assert state["provider"] == provider
        notices = [w["last_notice"] for w in state["watchers"] if w["last_notice"]]
        assert any(n["kind"] == "reclaim" for n in notices), state
        (wstate,) = [w for w in state["workloads"] if w["workload"] == WORKLOAD]
        assert wstate["reclaim"]["committed"] is True
        assert wstate["reclaim"]["job_id"] == job["id"]
        assert cli_json(b, "triggers")["standby"]["enabled"] is True
        seen_from_a = cli_json(a, "migrations")["migrations"]
        assert [(m["checkpoint_id"], m["status"]) for m in seen_from_a] == [(cid, "restored")]

        if isinstance(server, ApprovalWitness):
            eid = server.events[0]["EventId"]
            wait_for("the Azure approval", lambda: server.approvals)
            assert [e for e, _ in server.approvals] == [eid]
            # At the moment the approval arrived, the checkpoint was committed and published.
            (keys,) = server.keys_at_approval
            assert any(k.startswith("manifests/") and k.endswith(cid) for k in keys), keys
            assert f"migrations/{cid}/request" in keys


def test_two_standby_nodes_race_and_exactly_one_restores(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    with AwsImdsServer() as imds:
        b = _standby(cluster, "b", workload)
        c = _standby(cluster, "c", workload)
        a = _reclaimed_node(cluster, workload, "aws", imds.url)
        workload.reap_when_killed()
        imds.announce_reclaim()
        cid = committed_reclaim(a)["result"]["checkpoint_id"]

        done = finished_migration(a)
        winner = done["claim"]["node_id"]
        assert winner in ("b", "c")
        assert done["outcome"]["mode"] == "restored"
        workload.check_continues_identically(tmp_path)
        # The loser looked (it polls as often) but never restored; one claim object exists.
        loser = c if winner == "b" else b
        assert jobs(loser, "restore") == []
        assert len(jobs(b if winner == "b" else c, "restore")) == 1
        claims = [k for k in cluster.keys(f"migrations/{cid}/") if "/claim-" in k]
        assert claims == [f"migrations/{cid}/claim-0000"]


def test_a_standby_whose_stamp_does_not_match_leaves_the_workload_to_a_matching_one(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    with AwsImdsServer() as imds:
        # The mismatched node looks five times as often: were it to claim eagerly, it would win.
        c = _standby(cluster, "c", workload, revision="r2-other-build")
        cluster.node(
            "b",
            triggers_section("none")
            + migration_section(standby=True).replace(
                f"poll_interval = {POLL}", "poll_interval = 1.0"
            )
            + workload_section(workload.pid_file),
        )
        a = _reclaimed_node(cluster, workload, "aws", imds.url)
        workload.reap_when_killed()
        imds.announce_reclaim()
        cid = committed_reclaim(a)["result"]["checkpoint_id"]

        res = c.cli("compat", cid, "--json")  # exits non-zero: not compatible
        verdict = res.json
        assert res.rc != 0
        assert verdict["compatible"] is False
        assert any("model" in r["field"] for r in verdict["reasons"]), verdict
        done = finished_migration(a)
        assert done["claim"]["node_id"] == "b"
        assert done["outcome"]["mode"] == "restored"
        workload.check_continues_identically(tmp_path)
        assert jobs(c, "restore") == []


def test_with_no_matching_node_a_mismatched_standby_cold_starts_after_the_timeout(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    marker = tmp_path / "cold-started"
    wait_s = 3.0
    with AwsImdsServer() as imds:
        c = _standby(
            cluster,
            "c",
            workload,
            revision="r2-other-build",
            marker=marker,
            cold_start_after=wait_s,
        )
        a = _reclaimed_node(cluster, workload, "aws", imds.url)
        workload.reap_when_killed()
        imds.announce_reclaim()
        committed_reclaim(a)

        done = finished_migration(c)
        claim = done["claim"]
        assert claim["node_id"] == "c"
        assert claim["mode"] == "cold-start"
        assert claim["claimed_at"] - done["request"]["created_at"] >= wait_s
        assert "no compatible node claimed" in claim["reason"]
        assert "r2-other-build" in claim["reason"] or "model" in claim["reason"]
        assert done["outcome"]["mode"] == "cold-start"
        assert done["outcome"]["state"] == "succeeded"
        restore = cli_json(c, "job", done["outcome"]["job_id"])
        assert restore["result"]["mode"] == "cold-start"
        assert restore["result"]["reasons"], restore
        wait_for("the cold-start command to run", marker.exists)
        assert marker.read_text() == "cold"
        assert reclaim_jobs(c) == []
