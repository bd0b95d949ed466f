"""Reclaim edge cases on real daemons: a periodic checkpoint in flight, a notice that repeats,
metadata services that are down, slow or talk garbage, and the operator drill."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_reclaim import ask
from tests.e2e_reclaim.cluster import WORKLOAD, Cluster, ReclaimWorkload
from tests.support.faultproxy import GateProxy
from tests.support.metadata_servers import SERVERS, AwsImdsServer, MetadataServer, dead_url
from tests.support.waits import wait_for

pytestmark = [pytest.mark.criu, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_reclaim_during_a_periodic_checkpoint_supersedes_it_and_still_migrates(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    with AwsImdsServer() as imds, GateProxy(cluster.moto.endpoint_url, methods=("PUT",)) as proxy:
        cluster.standby("b", workload)
        proxy.gate.clear()  # the first periodic checkpoint will hang in its upload
        a = cluster.reclaimed(
            workload,
            "aws",
            imds.url,
            extra="checkpoint_interval = 3600\n",
            endpoint_url=proxy.endpoint_url,
        )

        def periodic_uploading() -> dict[str, object] | None:
            items = [j for j in ask.jobs(a, "checkpoint") if j["trigger"] == "schedule"]
            if items and items[0]["phase"] == "upload" and proxy.held:
                return items[0]
            return None

        periodic = wait_for("the periodic checkpoint to be uploading", periodic_uploading)
        workload.reap_when_killed()
        imds.announce_reclaim()

        def reclaim_taken() -> bool:
            (w,) = [
                w for w in ask.cli_json(a, "triggers")["workloads"] if w["workload"] == WORKLOAD
            ]
            return w["reclaim"] is not None

        wait_for("the policy to take the reclaim", reclaim_taken)
        cancelled = f"job {periodic['id']}: cancel requested"
        wait_for(
            "the reclaim to cancel the periodic checkpoint",
            lambda: cancelled in a.log_path.read_text(errors="replace"),
        )
        assert ask.cli_json(a, "job", str(periodic["id"]))["state"] == "running"
        proxy.gate.set()

        job = ask.committed_reclaim(a)
        assert job["result"]["committed_before_deadline"] is True
        first = ask.cli_json(a, "job", str(periodic["id"]))
        assert first["state"] == "cancelled", (first["error_kind"], first["error"])
        assert job["created_at"] >= first["finished_at"]  # one checkpoint of a workload at a time
        assert len(ask.reclaim_jobs(a)) == 1
        done = ask.finished_migration(a)
        assert done["checkpoint_id"] == job["result"]["checkpoint_id"]
        assert done["outcome"]["mode"] == "restored"
        workload.check_continues_identically(tmp_path)
        # No periodic checkpoint after the reclaim: the workload has left this node.
        assert [j["trigger"] for j in ask.jobs(a, "checkpoint")].count("schedule") == 1


def test_a_repeated_notice_starts_one_reclaim_checkpoint(
    cluster: Cluster, workload: ReclaimWorkload
) -> None:
    with AwsImdsServer() as imds:
        a = cluster.reclaimed(workload, "aws", imds.url)
        workload.reap_when_killed()
        imds.announce_reclaim(at=time.time() + 120)  # answered again on every poll
        job = ask.committed_reclaim(a)

        # The platform moves the time (a new notice as far as IMDS can tell).
        imds.announce_reclaim(at=time.time() + 90)
        second = imds.instance_action
        assert second is not None

        def polled_after_second_notice() -> bool:
            (w,) = ask.cli_json(a, "triggers")["watchers"]
            notice = w["last_notice"]
            return notice is not None and notice["detail"].find(second["time"]) >= 0

        wait_for("the watcher to see the moved notice", polled_after_second_notice)
        polls = ask.cli_json(a, "triggers")["watchers"][0]["polls"]
        wait_for(
            "two more polls",
            lambda: ask.cli_json(a, "triggers")["watchers"][0]["polls"] >= polls + 2,
        )

        assert [j["id"] for j in ask.reclaim_jobs(a)] == [job["id"]]
        assert [c["checkpoint_id"] for c in ask.cli_json(a, "ls")["checkpoints"]] == [
            job["result"]["checkpoint_id"]
        ]
        assert [m["checkpoint_id"] for m in ask.migrations(a)] == [job["result"]["checkpoint_id"]]


def _misbehaving(provider: str, mode: str) -> tuple[MetadataServer | None, str]:
    if mode == "down":
        return None, dead_url()
    server = SERVERS[provider]()
    server.mode = mode
    server.slow_s = 60.0  # far beyond the client's bound; server stop cuts it short
    server.start()
    return server, server.url


@pytest.mark.parametrize("mode", ["down", "slow", "garbage"])
@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_metadata_service_that_is_down_slow_or_garbled_starts_nothing_and_the_daemon_serves(
    provider: str, mode: str, cluster: Cluster, workload: ReclaimWorkload
) -> None:
    server, url = _misbehaving(provider, mode)
    try:
        a = cluster.reclaimed(workload, provider, url)
        # GCP long-polls: one slow poll is bounded by timeout_sec + a margin, so one is enough.
        failures = 1 if (provider, mode) == ("gcp", "slow") else 3

        def failed_polls() -> list[dict[str, Any]] | None:
            watchers: list[dict[str, Any]] = ask.cli_json(a, "triggers")["watchers"]
            enough = watchers and all(int(w["errors"]) >= failures for w in watchers)
            return watchers if enough else None

        watchers = wait_for(f"{failures} failed polls", failed_polls)
        for w in watchers:
            assert w["last_poll_ok"] is False
            assert w["last_error"]
            assert w["last_notice"] is None
        status = a.cli("status", "--json")
        assert status.rc == 0, status.stderr
        assert status.json["triggers"] is True
        assert a.proc is not None and a.proc.poll() is None
        assert ask.jobs(a) == []
        assert ask.cli_json(a, "triggers")["workloads"][0]["reclaim"] is None
        steps = len(workload.lines())
        wait_for("the workload to keep running", lambda: len(workload.lines()) > steps)
    finally:
        if server is not None:
            server.stop()


def test_drill_reclaim_runs_the_reclaim_path_and_a_standby_adopts_the_workload(
    cluster: Cluster, workload: ReclaimWorkload, tmp_path: Path
) -> None:
    cluster.standby("b", workload)
    a = cluster.reclaimed(workload)
    assert ask.cli_json(a, "triggers")["provider"] == "none"
    workload.reap_when_killed()
    before = time.time()
    drill = a.cli("drill", "reclaim", "--deadline", "60", "--json")
    assert drill.rc == 0, drill.stderr
    started = drill.json
    assert started["trigger"] == "drill"
    assert started["workload"] == WORKLOAD
    assert started["deadline"] >= before + 60 - 1

    job = ask.committed_reclaim(a)
    assert job["id"] == started["id"]
    assert job["result"]["leave_running"] is False
    assert job["result"]["committed_before_deadline"] is True
    done = ask.finished_migration(a)
    assert done["request"]["source_node"] == "a"
    assert done["claim"]["node_id"] == "b"
    assert done["outcome"]["mode"] == "restored"
    workload.check_continues_identically(tmp_path)
