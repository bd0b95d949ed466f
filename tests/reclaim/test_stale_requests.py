"""Migration requests that must not be adopted any more: expired (``[migration] request_ttl``),
withdrawn by an operator, or superseded by something newer of their workload (a later request,
a newer checkpoint in the store, a restore or checkpoint elsewhere). A standby added later
never starts a stale copy of a workload that ran on somewhere else."""

from __future__ import annotations

import pytest

from gpusnap.daemon.jobs.job import Job, JobKind, JobState
from gpusnap.daemon.reclaim.board import MigrationBoard
from gpusnap.daemon.reclaim.config import MigrationConfig, TriggersConfig, parse_migration
from gpusnap.daemon.reclaim.runtime import ReclaimRuntime
from gpusnap.daemon.reclaim.standby import StandbyLoop
from gpusnap.errors import FailedPrecondition, InvalidArgument
from gpusnap.storage.manifest import new_checkpoint_id
from gpusnap.storage.store import CheckpointStore
from tests.reclaim.fakes import FakeNode, FakeStore
from tests.reclaim.test_migration import Clock, board, compatible, restore_ok

pytestmark = pytest.mark.timeout(120)


def test_a_request_older_than_its_ttl_is_expired_and_never_claimed(
    store: CheckpointStore,
) -> None:
    clock = Clock()
    b = board(store, clock, request_ttl_s=60)
    cid = new_checkpoint_id()
    req = b.publish(cid, "llm", "node-a")
    assert b.get(cid).to_dict()["expires_at"] == req.created_at + 60
    clock.now += 61
    assert b.pending() == []
    assert b.get(cid).status == "expired"
    assert b.claim(cid, "node-b", "restore") is None
    calls, run = restore_ok("restored")
    assert StandbyLoop(b, "node-b", compatible, run, clock=clock).tick() == []
    assert calls == []


def test_a_claim_in_flight_outlives_the_ttl(store: CheckpointStore) -> None:
    clock = Clock()
    b = board(store, clock, request_ttl_s=60, claim_timeout_s=600)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    claim = b.claim(cid, "node-b", "restore")
    assert claim is not None
    clock.now += 120  # the restore takes its time: the request expired meanwhile
    assert b.get(cid).status == "claimed"
    b.record_outcome(claim, succeeded=True, mode="restored")
    assert b.get(cid).status == "restored"


def test_request_ttl_is_a_config_key_of_migration() -> None:
    assert parse_migration({}).request_ttl == 3600.0
    assert parse_migration({"request_ttl": 90}).request_ttl == 90.0
    with pytest.raises(InvalidArgument, match=r"\[migration\] request_ttl"):
        parse_migration({"request_ttl": 0})


def test_a_withdrawn_request_is_never_adopted_and_says_why(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    st = b.withdraw(cid, "node-a", "moved to the new cluster by hand")
    assert st.status == "withdrawn"
    assert st.outcome is not None and st.outcome.detail == "moved to the new cluster by hand"
    assert b.pending() == []
    assert b.claim(cid, "node-b", "restore") is None
    calls, run = restore_ok("restored")
    assert StandbyLoop(b, "node-b", compatible, run).tick() == []
    assert calls == []
    # An older daemon (no withdraw of its own) reads the same records as an ended migration.
    legacy = MigrationBoard(b.records)
    assert legacy.pending() == []
    with pytest.raises(FailedPrecondition, match="is withdrawn"):
        b.withdraw(cid, "node-a")


def test_a_claimed_request_cannot_be_withdrawn(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    assert b.claim(cid, "node-b", "restore") is not None
    with pytest.raises(FailedPrecondition, match="is claimed by node-b"):
        b.withdraw(cid, "node-a")
    with pytest.raises(InvalidArgument):
        b.claim(cid, "node-c", "withdraw")  # only withdraw() writes that claim


def test_a_newer_request_of_the_workload_supersedes_an_older_one(store: CheckpointStore) -> None:
    clock = Clock()
    b = board(store, clock)
    old, new = new_checkpoint_id(), new_checkpoint_id()
    b.publish(old, "llm", "node-a")
    clock.now += 10
    b.publish(new, "llm", "node-b")
    b.publish(new_checkpoint_id(), "other", "node-a")  # another workload: not a newer one
    assert b.get(old).status == "superseded"
    assert b.get(old).superseded_by == new
    assert sorted(r.workload for r in b.pending()) == ["llm", "other"]
    assert {r.checkpoint_id for r in b.pending() if r.workload == "llm"} == {new}


def test_a_standby_supersedes_a_request_whose_workload_has_a_newer_checkpoint(
    store: CheckpointStore,
) -> None:
    b = board(store)
    cid, newer = new_checkpoint_id(), new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    calls, run = restore_ok("restored")
    loop = StandbyLoop(b, "node-b", compatible, run, latest=lambda w: newer)
    assert loop.tick() == []
    assert calls == []
    st = b.get(cid)
    assert st.status == "superseded"
    assert st.outcome is not None and st.outcome.detail == f"checkpoint {newer} of llm is newer"
    # The request for the newest checkpoint itself is adopted as before.
    b.publish(newer, "llm", "node-a")
    (outcome,) = loop.tick()
    assert calls == [newer] and outcome.mode == "restored"


def test_supersede_ends_only_the_pending_requests_of_the_workload(store: CheckpointStore) -> None:
    clock = Clock()
    b = board(store, clock)
    claimed, pending, other = new_checkpoint_id(), new_checkpoint_id(), new_checkpoint_id()
    b.publish(claimed, "llm", "node-a")
    assert b.claim(claimed, "node-b", "restore") is not None
    clock.now += 1
    b.publish(pending, "llm", "node-a")
    b.publish(other, "other", "node-a")
    ended = b.supersede("llm", "node-c", "llm was restored on node-c by job j")
    assert ended == [pending]
    assert b.get(pending).status == "superseded"
    assert b.get(claimed).status == "claimed"  # its restore goes on and records its outcome
    assert b.get(other).status == "pending"


def test_a_restore_or_checkpoint_done_here_supersedes_the_workloads_pending_requests(
    store: CheckpointStore,
) -> None:
    node = FakeNode(store_handle=FakeStore(store))
    runtime = ReclaimRuntime(
        node,
        TriggersConfig(provider="none", logind=False),
        MigrationConfig(node_id="node-c"),
        [],
        daemon_node_id=None,
        store_verifies=True,
    )
    b = runtime.board
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    failed = Job("j0", JobKind.RESTORE, "llm", state=JobState.FAILED)
    runtime.on_job_finished(failed)
    assert b.get(cid).status == "pending"  # a failed restore changes nothing
    restored = Job("j1", JobKind.RESTORE, "llm", state=JobState.SUCCEEDED)
    restored.result = {"checkpoint_id": cid, "mode": "restored"}
    runtime.on_job_finished(restored)
    st = b.get(cid)
    assert st.status == "superseded"
    assert st.outcome is not None and st.outcome.detail == "llm was restored on node-c by job j1"

    later = new_checkpoint_id()
    b.publish(later, "llm", "node-a")
    checkpointed = Job("j2", JobKind.CHECKPOINT, "llm", state=JobState.SUCCEEDED)
    newest = new_checkpoint_id()
    checkpointed.result = {"checkpoint_id": newest}
    runtime.on_job_finished(checkpointed)
    st = b.get(later)
    assert st.status == "superseded"
    assert st.outcome is not None
    assert st.outcome.detail == f"checkpoint {newest} of llm (job j2 on node-c) is newer"
