"""The migration board and standby loop, on file:// and on S3 (moto over loopback HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gate.verdict import CompatVerdict, Reason
from gpusnap.daemon.jobs.job import Job, JobKind, JobState
from gpusnap.daemon.reclaim.board import (
    MigrationBoard,
    MigrationClaim,
    MigrationRequest,
    StoreRecords,
)
from gpusnap.daemon.reclaim.standby import RestoreRun, StandbyLoop
from gpusnap.errors import Corrupt, Unavailable
from gpusnap.storage.manifest import new_checkpoint_id
from gpusnap.storage.store import CheckpointStore
from tests.reclaim.stores import StoreSpec

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def board(store: CheckpointStore, clock: Clock | None = None, **kw: float) -> MigrationBoard:
    return MigrationBoard(StoreRecords(lambda: store), clock=clock or time.time, **kw)


def test_publish_pending_claim_outcome(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    req = b.publish(cid, "llm", "node-a", {"gpu": "H200"}, deadline=123.0)
    assert b.publish(cid, "llm", "node-a") == req  # idempotent
    assert [r.checkpoint_id for r in b.pending()] == [cid]
    claim = b.claim(cid, "node-b", "restore")
    assert claim is not None and claim.attempt == 0
    assert b.pending() == []
    assert b.claim(cid, "node-c", "restore") is None
    assert b.get(cid).status == "claimed"
    b.record_outcome(claim, succeeded=True, mode="restored", job_id="j1")
    (st,) = b.statuses()
    assert st.status == "restored"
    assert st.to_dict()["outcome"]["node_id"] == "node-b"
    assert st.request.stamp_summary == {"gpu": "H200"}


def test_records_are_signed_and_a_forged_request_is_ignored(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    store.backend.put(f"migrations/{cid}/request", b'{"checkpoint_id": "forged"}')
    assert b.pending() == []
    assert b.statuses() == []
    with pytest.raises(Corrupt):
        b.get(cid)


def test_a_stale_claim_is_taken_over_with_the_next_attempt(store: CheckpointStore) -> None:
    clock = Clock()
    b = board(store, clock, claim_timeout_s=60)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    first = b.claim(cid, "node-b", "restore")
    assert first is not None
    clock.now += 30
    assert b.pending() == []
    clock.now += 31
    assert [r.checkpoint_id for r in b.pending()] == [cid]
    second = b.claim(cid, "node-c", "restore")
    assert second is not None and second.attempt == 1
    assert b.get(cid).claim == second


def test_threads_racing_exactly_one_claim_wins(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    barrier = threading.Barrier(8)
    wins: list[MigrationClaim] = []
    errors: list[BaseException] = []

    def race(i: int) -> None:
        try:
            barrier.wait(10)
            c = b.claim(cid, f"node-{i}", "restore")
            if c is not None:
                wins.append(c)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(wins) == 1
    assert b.get(cid).claim == wins[0]


CHILD = r"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.reclaim.stores import StoreSpec
from gpusnap.daemon.reclaim.board import MigrationBoard, StoreRecords
spec = StoreSpec({url!r}, Path({key!r}), {endpoint!r})
store = spec.open(Path({cache!r}))
board = MigrationBoard(StoreRecords(lambda: store))
print("ready", flush=True)
go = Path({go!r})
end = time.monotonic() + 30
while not go.exists() and time.monotonic() < end:
    time.sleep(0.005)
claim = board.claim({cid!r}, sys.argv[1], "restore")
print("won" if claim else "lost", flush=True)
store.close()
"""


def test_processes_racing_exactly_one_claim_wins(
    store: CheckpointStore, store_spec: StoreSpec, tmp_path: Path
) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    go = tmp_path / "go"
    procs = []
    for i in range(4):
        code = CHILD.format(
            repo=str(REPO),
            url=store_spec.url,
            key=str(store_spec.key_file),
            endpoint=store_spec.endpoint_url,
            cache=str(tmp_path / f"cache-{i}"),
            go=str(go),
            cid=cid,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, f"node-{i}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=os.environ.copy(),
            )
        )
    for p in procs:  # each has opened the store and waits at the line
        assert p.stdout is not None
        assert p.stdout.readline() == b"ready\n", (
            p.stderr.read().decode()[-2000:] if p.stderr else ""
        )
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()[-2000:]
        results.append(out.decode().strip())
    assert sorted(results) == ["lost", "lost", "lost", "won"]
    winner = b.get(cid).claim
    assert winner is not None
    assert results[int(winner.node_id.split("-")[1])] == "won"


# --- standby loop -----------------------------------------------------------------------------


def restore_ok(mode: str) -> tuple[list[str], RestoreRun]:
    calls: list[str] = []

    def run(req: MigrationRequest, claim: MigrationClaim) -> Job:
        calls.append(req.checkpoint_id)
        job = Job("r1", JobKind.RESTORE, req.workload, state=JobState.SUCCEEDED)
        job.result = {"checkpoint_id": req.checkpoint_id, "mode": mode}
        return job

    return calls, run


def compatible(cid: str) -> CompatVerdict:
    return CompatVerdict(cid, True)


def incompatible(cid: str) -> CompatVerdict:
    r = Reason("gpu.driver_version", "580.65", "575.51", "driver 575.51 differs from 580.65")
    return CompatVerdict(cid, False, (r,))


def test_compatible_standby_claims_at_once_and_records_restored(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    calls, run = restore_ok("restored")
    loop = StandbyLoop(b, "node-b", compatible, run)
    (outcome,) = loop.tick()
    assert calls == [cid]
    assert (outcome.state, outcome.mode, outcome.node_id) == ("succeeded", "restored", "node-b")
    assert loop.tick() == []  # done: nothing pending
    assert b.get(cid).status == "restored"


def test_source_node_does_not_adopt_its_own_workload(store: CheckpointStore) -> None:
    b = board(store)
    b.publish(new_checkpoint_id(), "llm", "node-a")
    calls, run = restore_ok("restored")
    assert StandbyLoop(b, "node-a", compatible, run).tick() == []
    assert calls == []


def test_incompatible_node_claims_only_after_the_timeout(store: CheckpointStore) -> None:
    clock = Clock()
    b = board(store, clock)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    calls, run = restore_ok("cold-start")
    loop = StandbyLoop(b, "node-x", incompatible, run, cold_start_after_s=60, clock=clock)
    assert loop.tick() == []
    clock.now += 59
    assert loop.tick() == []
    assert b.get(cid).status == "pending"
    clock.now += 2
    (outcome,) = loop.tick()
    assert calls == [cid]
    assert outcome.mode == "cold-start"
    st = b.get(cid)
    assert st.claim is not None and st.claim.mode == "cold-start"
    assert "driver 575.51 differs" in st.claim.reason
    assert "60 s" in st.claim.reason


def test_compatible_node_wins_over_an_incompatible_one_before_the_timeout(
    store: CheckpointStore,
) -> None:
    clock = Clock()
    b = board(store, clock)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    cold_calls, cold_run = restore_ok("cold-start")
    warm_calls, warm_run = restore_ok("restored")
    bad = StandbyLoop(b, "node-x", incompatible, cold_run, cold_start_after_s=60, clock=clock)
    good = StandbyLoop(b, "node-y", compatible, warm_run, clock=clock)
    assert bad.tick() == []
    assert len(good.tick()) == 1
    clock.now += 120
    assert bad.tick() == []
    assert (cold_calls, warm_calls) == ([], [cid])


def test_failed_restore_is_recorded(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")

    def run(req: MigrationRequest, claim: MigrationClaim) -> Job:
        job = Job("r2", JobKind.RESTORE, req.workload, state=JobState.FAILED)
        job.error = "criu restore failed: exit 1"
        return job

    (outcome,) = StandbyLoop(b, "node-b", compatible, run).tick()
    assert outcome.state == "failed" and "criu restore failed" in outcome.detail
    assert b.get(cid).status == "failed"


class OutcomePutFails(StoreRecords):
    """The store's records, except that the first ``times`` puts of an outcome fail."""

    def __init__(self, store: CheckpointStore, times: int) -> None:
        super().__init__(lambda: store)
        self.times = times

    def create(self, name: str, record: Mapping[str, Any]) -> None:
        if name.endswith("/outcome") and self.times > 0:
            self.times -= 1
            raise Unavailable("store unreachable: connection refused")
        super().create(name, record)


def standby_whose_outcome_is_refused(
    store: CheckpointStore, times: int
) -> tuple[MigrationBoard, str, list[str], StandbyLoop]:
    """A published request and a compatible standby whose first ``times`` outcome puts fail."""
    b = MigrationBoard(OutcomePutFails(store, times=times))
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    calls, run = restore_ok("restored")
    return b, cid, calls, StandbyLoop(b, "node-b", compatible, run)


def test_an_outcome_the_store_refused_is_retried_and_the_restore_not_run_twice(
    store: CheckpointStore,
) -> None:
    # Lost, the outcome would leave the claim live and then stale after the claim timeout:
    # another node would take it over and start the workload a second time.
    b, cid, calls, loop = standby_whose_outcome_is_refused(store, times=2)
    assert loop.tick() == []  # restored; the outcome did not land
    assert b.get(cid).status == "claimed"
    assert loop.tick() == []  # the store still refuses it; still kept
    (outcome,) = loop.tick()
    assert (outcome.state, outcome.mode, outcome.node_id) == ("succeeded", "restored", "node-b")
    assert calls == [cid]  # restored once
    assert b.get(cid).status == "restored"
    assert loop.tick() == []


def test_an_unrecorded_outcome_gets_a_last_try_when_the_standby_stops(
    store: CheckpointStore,
) -> None:
    b, cid, _calls, loop = standby_whose_outcome_is_refused(store, times=1)
    assert loop.tick() == []
    assert b.get(cid).status == "claimed"
    loop.stop()
    assert b.get(cid).status == "restored"


# --- records that do not hold are ignored, and cannot stall a migration -------------------------


def _sealed(store: CheckpointStore, kind: str, **fields: object) -> bytes:
    """A record validly signed with the store's key, with whatever fields a test wants."""
    doc = {"format": f"gpusnap.migration.{kind}/1", **fields}
    return store.sign(json.dumps(doc).encode())


def test_a_planted_garbage_claim_does_not_stall_the_migration(store: CheckpointStore) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    store.backend.put(f"migrations/{cid}/claim-9999", b"garbage from someone without the key")
    store.backend.put(f"migrations/{cid}/claim-0000", b"{}")
    assert [r.checkpoint_id for r in b.pending()] == [cid]
    calls, run = restore_ok("restored")
    (outcome,) = StandbyLoop(b, "node-b", compatible, run).tick()
    assert calls == [cid]
    assert outcome.attempt == 10000  # after every claim name present, valid or not
    st = b.get(cid)
    assert st.status == "restored"
    assert st.claim is not None and st.claim.node_id == "node-b"


def test_a_planted_garbage_outcome_neither_ends_the_migration_nor_keeps_the_real_one_out(
    store: CheckpointStore,
) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    store.backend.put(f"migrations/{cid}/outcome", b"not a record")
    assert b.get(cid).status == "pending"
    assert [r.checkpoint_id for r in b.pending()] == [cid]
    calls, run = restore_ok("restored")
    (outcome,) = StandbyLoop(b, "node-b", compatible, run).tick()
    assert calls == [cid]
    st = b.get(cid)
    assert st.status == "restored" and st.outcome == outcome


def test_signed_records_of_another_checkpoint_do_not_count_in_this_one(
    store: CheckpointStore,
) -> None:
    # Copied from another migration's folder: signed, but not about this checkpoint.
    b = board(store)
    other, cid = new_checkpoint_id(), new_checkpoint_id()
    b.publish(other, "llm", "node-a")
    claim = b.claim(other, "node-b", "restore")
    assert claim is not None
    b.record_outcome(claim, succeeded=True, mode="restored")
    b.publish(cid, "llm", "node-a")
    for name in ("claim-0000", "outcome"):
        blob = store.backend.get(f"migrations/{other}/{name}")
        store.backend.put(f"migrations/{cid}/{name}", blob)
    st = b.get(cid)
    assert (st.status, st.claim, st.outcome) == ("pending", None, None)
    assert [r.checkpoint_id for r in b.pending()] == [cid]
    mine = b.claim(cid, "node-c", "restore")
    assert mine is not None and mine.attempt == 1
    b.record_outcome(mine, succeeded=True, mode="restored")
    outcome = b.get(cid).outcome
    assert outcome is not None and outcome.node_id == "node-c"


@pytest.mark.parametrize(
    "bad",
    [
        {"attempt": "0"},
        {"attempt": 3},  # not the number in its name
        {"mode": "exec"},
        {"claimed_at": None},
        {"node_id": ["node-z"]},
    ],
    ids=["attempt-a-string", "attempt-not-its-name", "unknown-mode", "no-time", "node-a-list"],
)
def test_a_signed_but_malformed_claim_is_ignored(
    store: CheckpointStore, bad: dict[str, Any]
) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    b.publish(cid, "llm", "node-a")
    good = {
        "checkpoint_id": cid,
        "node_id": "node-z",
        "mode": "restore",
        "attempt": 0,
        "claimed_at": time.time(),
        "reason": "",
        "nonce": "x",
    }
    store.backend.put(f"migrations/{cid}/claim-0000", _sealed(store, "claim", **{**good, **bad}))
    assert b.get(cid).claim is None
    assert [r.checkpoint_id for r in b.pending()] == [cid]


def test_a_signed_request_with_wrong_types_is_skipped_without_stalling_the_others(
    store: CheckpointStore,
) -> None:
    b = board(store)
    bad, good = new_checkpoint_id(), new_checkpoint_id()
    store.backend.put(
        f"migrations/{bad}/request",
        _sealed(
            store,
            "request",
            checkpoint_id=bad,
            workload="llm",
            source_node="node-a",
            created_at="yesterday",
        ),
    )
    b.publish(good, "llm", "node-a")
    assert [r.checkpoint_id for r in b.pending()] == [good]
    assert [s.request.checkpoint_id for s in b.statuses()] == [good]


def test_a_garbage_request_is_replaced_when_the_checkpoint_is_published(
    store: CheckpointStore,
) -> None:
    b = board(store)
    cid = new_checkpoint_id()
    store.backend.put(f"migrations/{cid}/request", b"planted before the publish")
    req = b.publish(cid, "llm", "node-a")
    assert b.get(cid).request == req
    assert [r.checkpoint_id for r in b.pending()] == [cid]
