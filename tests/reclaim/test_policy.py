"""The policy engine: notices and schedules into checkpoint jobs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from gpusnap.daemon.jobs.job import Job, JobState
from gpusnap.daemon.reclaim.aws import AwsImdsWatcher
from gpusnap.daemon.reclaim.azure import AzureScheduledEventsWatcher
from gpusnap.daemon.reclaim.config import TriggersConfig, WorkloadPolicy
from gpusnap.daemon.reclaim.manager import TriggerManager
from gpusnap.daemon.reclaim.notice import Notice, drill_notice
from gpusnap.daemon.reclaim.policy import PolicyEngine
from tests.reclaim.fakes import FakeNode
from tests.support.metadata_servers import AwsImdsServer, AzureEventsServer

pytestmark = pytest.mark.timeout(60)


def wait_for(cond: Callable[[], bool], timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self.done = threading.Event()

    def ack(self) -> None:
        self.events.append(("ack", time.monotonic()))

    def on_done(self) -> None:
        self.events.append(("done", time.monotonic()))
        self.done.set()


def notice(
    rec: Recorder, *, event_id: str = "e1", provider: str = "aws", left: float = 120
) -> Notice:
    return Notice(
        provider, "reclaim", time.time() + left, event_id, ack=rec.ack, on_done=rec.on_done
    )


def test_reclaim_checkpoints_in_kill_mode_against_the_deadline_then_acks() -> None:
    node = FakeNode(auto={"kill": JobState.SUCCEEDED})
    committed: list[tuple[Notice, Job]] = []
    eng = PolicyEngine(
        node, [WorkloadPolicy("llm")], on_committed=lambda n, j: committed.append((n, j))
    )
    rec = Recorder()
    n = notice(rec)
    eng.on_notice(n)
    assert rec.done.wait(10)
    (call,) = node.calls
    assert (call.workload, call.leave_running, call.trigger) == ("llm", False, "reclaim:aws")
    assert call.deadline == n.deadline
    assert call.compress is True  # 120 s left, plenty
    assert [e[0] for e in rec.events] == ["ack", "done"]
    assert committed == [(n, node.jobs[call.job_id])]  # the hook got the committed job


def test_ack_waits_for_the_commit() -> None:
    node = FakeNode()
    eng = PolicyEngine(node, [WorkloadPolicy("llm")])
    rec = Recorder()
    eng.on_notice(notice(rec))
    (call,) = node.wait_calls(1)
    time.sleep(0.2)
    assert rec.events == []  # still checkpointing: no approval yet
    assert eng.reclaim_in_flight()
    node.finish(call.job_id)
    assert rec.done.wait(10)
    assert rec.events[0][1] >= node.commit_times[call.job_id]
    assert not eng.reclaim_in_flight()


def test_failed_reclaim_is_not_acknowledged_but_is_done() -> None:
    node = FakeNode(auto={"kill": JobState.FAILED})
    eng = PolicyEngine(node, [WorkloadPolicy("llm")])
    rec = Recorder()
    eng.on_notice(notice(rec))
    assert rec.done.wait(10)
    assert [e[0] for e in rec.events] == ["done"]


def test_repeated_and_second_source_notices_start_one_reclaim() -> None:
    node = FakeNode()
    eng = PolicyEngine(node, [WorkloadPolicy("llm")])
    a, b, c = Recorder(), Recorder(), Recorder()
    eng.on_notice(notice(a, event_id="x"))
    eng.on_notice(notice(b, event_id="x"))  # a repeat that got past dedup
    eng.on_notice(notice(c, event_id="sigterm", provider="node"))  # another source
    (call,) = node.wait_calls(1)
    node.finish(call.job_id)
    for r in (a, b, c):
        assert r.done.wait(10)
        assert [e[0] for e in r.events] == ["ack", "done"]
    time.sleep(0.1)
    assert len(node.calls) == 1
    # After the commit the workload is gone: a later notice still starts nothing.
    d = Recorder()
    eng.on_notice(notice(d, event_id="later"))
    assert d.done.wait(10)
    assert len(node.calls) == 1


def test_on_notice_none_does_nothing() -> None:
    node = FakeNode(auto={"kill": JobState.SUCCEEDED})
    eng = PolicyEngine(node, [WorkloadPolicy("batch", on_notice="none")])
    rec = Recorder()
    eng.on_notice(notice(rec))
    assert rec.done.wait(10)
    assert node.calls == []
    assert [e[0] for e in rec.events] == ["done"]  # nothing committed: nothing approved


def test_reclaim_supersedes_a_running_periodic_checkpoint() -> None:
    node = FakeNode()
    eng = PolicyEngine(node, [WorkloadPolicy("llm", checkpoint_interval=3600)])
    eng.tick()
    (periodic,) = node.wait_calls(1)
    assert periodic.leave_running is True and periodic.trigger == "schedule"
    eng.tick()  # still running: no second periodic
    assert len(node.calls) == 1
    rec = Recorder()
    eng.on_notice(notice(rec))
    calls = node.wait_calls(2)
    assert len(calls) == 2
    reclaim = calls[1]
    assert reclaim.leave_running is False
    assert node.cancels and node.cancels[0][0] == periodic.job_id
    assert node.cancels[0][1] <= reclaim.at  # cancelled before the reclaim began
    assert node.jobs[periodic.job_id].state == JobState.CANCELLED
    node.finish(reclaim.job_id)
    assert rec.done.wait(10)
    eng.tick()  # reclaimed: no periodic checkpoints any more
    time.sleep(0.1)
    assert len(node.calls) == 2


def test_reclaim_waits_for_a_periodic_that_cannot_be_cancelled() -> None:
    node = FakeNode(can_cancel=False)
    eng = PolicyEngine(node, [WorkloadPolicy("llm", checkpoint_interval=3600)], cancel_wait_s=5)
    eng.tick()
    (periodic,) = node.wait_calls(1)
    rec = Recorder()
    eng.on_notice(notice(rec))
    time.sleep(0.3)
    assert len(node.calls) == 1  # waiting for the periodic one
    node.finish(periodic.job_id)
    calls = node.wait_calls(2)
    assert len(calls) == 2 and calls[1].leave_running is False
    node.finish(calls[1].job_id)
    assert rec.done.wait(10)


def test_reclaim_waits_for_a_checkpoint_it_did_not_start() -> None:
    node = FakeNode()
    operator_job = node.checkpoint(
        workload="llm", leave_running=True, trigger="operator", deadline=None, compress=True
    )
    eng = PolicyEngine(node, [WorkloadPolicy("llm")])
    rec = Recorder()
    n = notice(rec)
    eng.on_notice(n)
    time.sleep(0.5)
    assert len(node.calls) == 1  # refused while the operator's job holds the workload
    node.finish(operator_job.id)
    calls = node.wait_calls(2)
    assert len(calls) == 2 and calls[1].leave_running is False
    assert eng.jobs_for(n) == [calls[1].job_id]
    node.finish(calls[1].job_id)
    assert rec.done.wait(10)
    assert [e[0] for e in rec.events] == ["ack", "done"]


def test_compression_is_skipped_when_behind_schedule() -> None:
    node = FakeNode(auto={"kill": JobState.SUCCEEDED})
    eng = PolicyEngine(node, [WorkloadPolicy("llm")], uncompressed_below_s=60)
    rec = Recorder()
    eng.on_notice(notice(rec, left=20))
    assert rec.done.wait(10)
    assert node.calls[0].compress is False


def test_rebalance_starts_an_early_leave_running_checkpoint() -> None:
    node = FakeNode(auto={"keep": JobState.SUCCEEDED})
    eng = PolicyEngine(
        node,
        [WorkloadPolicy("llm"), WorkloadPolicy("other", checkpoint_on_rebalance=False)],
    )
    eng.on_notice(Notice("aws", "rebalance", None, "rebalance-t"))
    (call,) = node.wait_calls(1)
    time.sleep(0.1)
    assert len(node.calls) == 1
    assert (call.workload, call.leave_running, call.trigger) == ("llm", True, "rebalance:aws")


def test_drill_runs_the_reclaim_path_with_trigger_drill() -> None:
    node = FakeNode(auto={"kill": JobState.SUCCEEDED})
    eng = PolicyEngine(node, [WorkloadPolicy("llm")])
    n = drill_notice(45)
    eng.on_notice(n)
    (call,) = node.wait_calls(1)
    assert call.trigger == "drill" and call.leave_running is False
    assert call.deadline == n.deadline


# --- through real watchers and loopback servers ---------------------------------------------


def test_azure_is_approved_only_after_the_commit() -> None:
    with AzureEventsServer() as server:
        eid = server.schedule("Preempt")
        node = FakeNode()
        eng = PolicyEngine(node, [WorkloadPolicy("llm")])
        w = AzureScheduledEventsWatcher(
            TriggersConfig(azure_metadata_url=server.url, azure_poll_interval=0.05)
        )
        mgr = TriggerManager([w], eng.on_notice)
        mgr.start()
        try:
            (call,) = node.wait_calls(1)
            time.sleep(0.5)  # many polls see the event; none approves it
            assert server.approvals == []
            node.finish(call.job_id)
            assert wait_for(lambda: len(server.approvals) == 1)
        finally:
            mgr.stop()
        assert len(node.calls) == 1
        (post,) = server.requests_to("/metadata/scheduledevents", "POST")
        assert json.loads(post.body) == {"StartRequests": [{"EventId": eid}]}
        assert post.at > node.commit_times[call.job_id]


def test_aws_notice_polled_many_times_starts_one_checkpoint() -> None:
    with AwsImdsServer() as server:
        server.announce_reclaim()
        node = FakeNode(auto={"kill": JobState.SUCCEEDED})
        eng = PolicyEngine(node, [WorkloadPolicy("a"), WorkloadPolicy("b")])
        w = AwsImdsWatcher(TriggersConfig(aws_imds_url=server.url, poll_interval=0.02))
        mgr = TriggerManager([w], eng.on_notice)
        mgr.start()
        try:
            assert wait_for(lambda: mgr.state()[0].polls >= 10)
        finally:
            mgr.stop()
        assert sorted(c.workload for c in node.calls) == ["a", "b"]
