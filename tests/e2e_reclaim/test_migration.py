"""A cloud reclaims node A; A checkpoints before the deadline and publishes; a standby node
adopts the workload exactly once — real daemons, real CRIU, a moto S3 store over HTTP."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e_reclaim import ask
from tests.e2e_reclaim.cluster import WORKLOAD, Cluster, ReclaimWorkload
from tests.support.metadata_servers import (
    SERVERS,
    AwsImdsServer,
    AzureEventsServer,
    MetadataServer,
    Recorded,
)
from tests.support.waits import wait_for

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
    return ApprovalWitness(cluster) if provider == "azure" else SERVERS[provider]()


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_reclaim_notice_checkpoints_before_the_deadline_and_the_standby_continues_it(
    provider: str, cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    with _server(provider, cluster) as server:
        b = cluster.standby("b", workload)
        a = cluster.reclaimed(workload, provider, server.url)
        workload.reap_when_killed()
        given_deadline = server.reclaim(time.time() + 120)

        job = ask.committed_reclaim(a)
        assert job["trigger"] == f"reclaim:{provider}"
        assert job["result"]["leave_running"] is False
        assert job["result"]["committed_before_deadline"] is True
        if given_deadline is not None:  # AWS, Azure: the notice's own time is the deadline
            assert job["deadline"] == pytest.approx(given_deadline, abs=1)
        cid = job["result"]["checkpoint_id"]

        done = ask.finished_migration(b)
        assert done["checkpoint_id"] == cid
        assert done["status"] == "restored"
        assert done["request"]["source_node"] == "a"
        assert done["claim"]["node_id"] == "b"
        assert done["claim"]["mode"] == "restore"
        assert done["outcome"]["mode"] == "restored", done
        restore = ask.cli_json(b, "job", done["outcome"]["job_id"])
        assert restore["result"]["pids"][0] == workload.pid
        workload.check_continues_identically(tmp_path)

        # What an operator sees on each node.
        state = ask.cli_json(a, "triggers")
        assert state["provider"] == provider
        notices = [w["last_notice"] for w in state["watchers"] if w["last_notice"]]
        assert any(n["kind"] == "reclaim" for n in notices), state
        (wstate,) = [w for w in state["workloads"] if w["workload"] == WORKLOAD]
        assert wstate["reclaim"]["committed"] is True
        assert wstate["reclaim"]["job_id"] == job["id"]
        assert ask.cli_json(b, "triggers")["standby"]["enabled"] is True
        seen_from_a = ask.cli_json(a, "migrations")["migrations"]
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
        b = cluster.standby("b", workload)
        c = cluster.standby("c", workload)
        a = cluster.reclaimed(workload, "aws", imds.url)
        workload.reap_when_killed()
        imds.announce_reclaim()
        cid = ask.committed_reclaim(a)["result"]["checkpoint_id"]

        done = ask.finished_migration(a)
        winner = done["claim"]["node_id"]
        assert winner in ("b", "c")
        assert done["outcome"]["mode"] == "restored"
        workload.check_continues_identically(tmp_path)
        # The loser looked (it polls as often) but never restored; one claim object exists.
        loser = c if winner == "b" else b
        assert ask.jobs(loser, "restore") == []
        assert len(ask.jobs(b if winner == "b" else c, "restore")) == 1
        claims = [k for k in cluster.keys(f"migrations/{cid}/") if "/claim-" in k]
        assert claims == [f"migrations/{cid}/claim-0000"]


def test_a_standby_whose_stamp_does_not_match_leaves_the_workload_to_a_matching_one(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    with AwsImdsServer() as imds:
        # The mismatched node looks five times as often: were it to claim eagerly, it would win.
        c = cluster.standby("c", workload, revision="r2-other-build")
        cluster.standby("b", workload, poll_interval=1.0)
        a = cluster.reclaimed(workload, "aws", imds.url)
        workload.reap_when_killed()
        imds.announce_reclaim()
        cid = ask.committed_reclaim(a)["result"]["checkpoint_id"]

        res = c.cli("compat", cid, "--json")  # exits non-zero: not compatible
        verdict = res.json
        assert res.rc != 0
        assert verdict["compatible"] is False
        assert any("model" in r["field"] for r in verdict["reasons"]), verdict
        done = ask.finished_migration(a)
        assert done["claim"]["node_id"] == "b"
        assert done["outcome"]["mode"] == "restored"
        workload.check_continues_identically(tmp_path)
        assert ask.jobs(c, "restore") == []


def test_with_no_matching_node_a_mismatched_standby_cold_starts_after_the_timeout(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    marker = tmp_path / "cold-started"
    wait_s = 3.0
    with AwsImdsServer() as imds:
        c = cluster.standby(
            "c",
            workload,
            revision="r2-other-build",
            marker=marker,
            cold_start_after=wait_s,
        )
        a = cluster.reclaimed(workload, "aws", imds.url)
        workload.reap_when_killed()
        imds.announce_reclaim()
        ask.committed_reclaim(a)

        done = ask.finished_migration(c)
        claim = done["claim"]
        assert claim["node_id"] == "c"
        assert claim["mode"] == "cold-start"
        assert claim["claimed_at"] - done["request"]["created_at"] >= wait_s
        assert "no compatible node claimed" in claim["reason"]
        assert "r2-other-build" in claim["reason"] or "model" in claim["reason"]
        assert done["outcome"]["mode"] == "cold-start"
        assert done["outcome"]["state"] == "succeeded"
        restore = ask.cli_json(c, "job", done["outcome"]["job_id"])
        assert restore["result"]["mode"] == "cold-start"
        assert restore["result"]["reasons"], restore
        wait_for("the cold-start command to run", marker.exists)
        assert marker.read_text() == "cold"
        assert ask.reclaim_jobs(c) == []
