"""The background store check (``daemon/node/storecheck.py``) over a real ``file://`` store: what a
check finds and names, what survives a restart, the schedule's priority and its retries, and
``[store] check_interval`` in the config. Through the real daemon: tests/e2e/test_store_check.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.cli.daemon_cmds import _store_check_lines
from gpusnap.daemon.config.file import DEFAULT_CHECK_INTERVAL, Config, parse_config
from gpusnap.daemon.infra.metrics import MetricsRegistry
from gpusnap.daemon.jobs.executor import JobContext, JobExecutor
from gpusnap.daemon.jobs.job import JobKind
from gpusnap.daemon.jobs.journal import Journal
from gpusnap.daemon.node.node import StoreHandle
from gpusnap.daemon.node.storecheck import CheckSummary, StoreChecker, summarize
from gpusnap.daemon.pipelines.checkpoint import full_push_reason
from gpusnap.errors import InvalidArgument
from gpusnap.storage import ManifestSummary, StoreCheck, generate_signing_key, open_store
from gpusnap.storage.layout import chunk_key
from tests.support.tls import free_port

HANG_GUARD = 60.0


def _until(what: str, ready: Callable[[], bool]) -> None:
    end = time.monotonic() + HANG_GUARD
    while not ready():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.02)


def _config(tmp_path: Path, store: dict[str, Any]) -> Config:
    return parse_config(
        {
            "daemon": {"socket": str(tmp_path / "d.sock"), "state_dir": str(tmp_path / "state")},
            "store": store,
            "gpu": {"driver": "none"},
        }
    )


class Scene:
    """A store with checkpoints A and L (L's parent: A) of ``svc`` and O of ``other``, and a
    chunk that A and L both name deleted behind the store's back."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "store"
        self.url = f"file://{self.root}"
        self.key = tmp_path / "signing.key"
        generate_signing_key(self.key)
        tree = tmp_path / "tree"
        tree.mkdir()
        (tree / "pages-1.img").write_bytes(os.urandom(300_000))
        (tree / "core.img").write_bytes(b"first")
        with open_store(self.url, key_file=self.key, cache_dir=tmp_path / "pusher") as store:
            self.a = store.push(tree, workload="svc").checkpoint_id
            (tree / "core.img").write_bytes(b"second")
            self.l = store.push(tree, workload="svc", parent=self.a).checkpoint_id
            other = tmp_path / "other"
            other.mkdir()
            (other / "pages-1.img").write_bytes(os.urandom(300_000))
            self.o = store.push(other, workload="other").checkpoint_id
            chunks_a = {c.id for f in store.manifest(self.a).files for c in f.chunks}
            chunks_l = {c.id for f in store.manifest(self.l).files for c in f.chunks}
            chunks_o = {c.id for f in store.manifest(self.o).files for c in f.chunks}
        # A page chunk: A and L name it (L's pages are A's), O does not.
        self.lost = sorted((chunks_a & chunks_l) - chunks_o)[0]
        self.config = _config(tmp_path, {"url": self.url, "key_file": str(self.key)})
        self.state_file = tmp_path / "state" / "store-check.json"
        self.state_file.parent.mkdir()

    def lose_a_chunk(self) -> None:
        (self.root / chunk_key(self.lost)).unlink()

    def found_damaged(self, handle: StoreHandle) -> tuple[StoreChecker, CheckSummary, str]:
        """The chunk lost, a check run: its checker, its findings, why svc's next is full."""
        self.lose_a_chunk()
        checker = self.checker(handle)
        found = checker.check_now()
        reason = checker.full_reason("svc")
        assert reason is not None
        return checker, found, reason

    def checker(self, handle: StoreHandle, **kw: Any) -> StoreChecker:
        kw.setdefault("interval", 0)
        kw.setdefault("metrics", MetricsRegistry())
        return StoreChecker(handle, state_file=self.state_file, store_url=self.url, **kw)


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    return Scene(tmp_path)


@pytest.fixture
def handle(scene: Scene) -> Iterator[StoreHandle]:
    h = StoreHandle(scene.config)
    yield h
    h.close()


def test_a_check_names_each_damaged_checkpoint_its_workload_and_flags_a_damaged_latest(
    scene: Scene, handle: StoreHandle, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = MetricsRegistry()
    checker = scene.checker(handle, metrics=metrics)
    clean = checker.check_now()
    assert clean.damaged == () and clean.chunks_missing == 0 and clean.checkpoints_checked == 3
    assert checker.full_reason("svc") is None
    assert "gpusnap_store_missing_chunks 0\n" in metrics.render()

    scene.lose_a_chunk()
    caplog.set_level(logging.INFO, logger="gpusnap.daemon.node.storecheck")
    found = checker.check_now()

    by_id = {d.checkpoint_id: d for d in found.damaged}
    assert set(by_id) == {scene.a, scene.l}
    assert (by_id[scene.l].workload, by_id[scene.l].missing_chunks, by_id[scene.l].latest) == (
        "svc",
        1,
        True,
    )
    assert (by_id[scene.a].workload, by_id[scene.a].latest) == ("svc", False)
    assert found.chunks_missing == 1 and found.checkpoints_checked == 3
    reason = checker.full_reason("svc")
    assert reason is not None and scene.l in reason and "1 chunk(s)" in reason
    assert checker.full_reason("other") is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors
    (on_latest,) = [e for e in errors if scene.l in e]
    assert (
        "svc" in on_latest
        and "1 chunk(s)" in on_latest
        and "next checkpoint is a full" in (on_latest)
    )
    (on_first,) = [e for e in errors if scene.a in e]
    assert "svc" in on_first and "full" not in on_first
    # The lost chunk is dropped from the index, so the next push uploads it again.
    assert not handle.get().index.contains(scene.lost)

    rendered = metrics.render()
    assert "gpusnap_store_missing_chunks 1\n" in rendered
    assert "gpusnap_store_damaged_checkpoints 2\n" in rendered
    assert f"gpusnap_store_last_check_timestamp_seconds {found.checked_at!r}" in rendered
    status = checker.status()
    assert status["chunks_missing"] == 1 and status["last_check_at"] == found.checked_at
    assert status["full_next"] == {"svc": reason}
    assert status["next_check_at"] is None  # no schedule runs: interval 0, never started
    assert {d["checkpoint_id"] for d in status["damaged"]} == {scene.a, scene.l}

    text = "\n".join(_store_check_lines(status))
    assert "store check: off; last " in text and "1 missing" in text
    assert "DAMAGED CHECKPOINT" in text and scene.l in text and scene.a in text
    assert f"next checkpoint of svc is a full one: {reason}" in text


def test_the_findings_and_the_pending_full_checkpoint_survive_a_restart(
    scene: Scene, handle: StoreHandle
) -> None:
    before, found, reason = scene.found_damaged(handle)
    metrics = MetricsRegistry()
    after = scene.checker(handle, metrics=metrics)
    assert after.full_reason("svc") == reason
    assert after.status() == before.status()
    assert "gpusnap_store_damaged_checkpoints 2\n" in metrics.render()

    after.full_committed("svc", "20261130T083000Z-0123456789")
    assert after.full_reason("svc") is None
    again = scene.checker(handle)
    assert again.full_reason("svc") is None
    assert again.status()["last_check_at"] == found.checked_at  # the findings stay


def test_a_full_checkpoint_committed_while_a_check_ran_is_not_made_full_again(
    scene: Scene, handle: StoreHandle
) -> None:
    checker, found, _reason = scene.found_damaged(handle)
    checker.full_committed("svc", "20261130T083000Z-0123456789")
    # The same findings arriving after that commit (a check that began before it).
    checker._record(found)
    assert checker.full_reason("svc") is None


def test_a_state_file_of_another_store_or_not_the_daemons_is_ignored(
    scene: Scene, handle: StoreHandle, caplog: pytest.LogCaptureFixture
) -> None:
    scene.lose_a_chunk()
    scene.checker(handle).check_now()
    kept = json.loads(scene.state_file.read_text())
    assert kept["full_next"].keys() == {"svc"}

    scene.state_file.write_text(json.dumps({**kept, "store_url": "file:///elsewhere"}))
    assert scene.checker(handle).status()["last_check_at"] is None
    for bad in ("{not json", json.dumps({**kept, "full_next": {"svc": 3}}), "[]"):
        scene.state_file.write_text(bad)
        with caplog.at_level(logging.WARNING, logger="gpusnap.daemon.node.storecheck"):
            checker = scene.checker(handle)
        assert checker.full_reason("svc") is None and checker.status()["last_check_at"] is None
        assert "ignoring" in caplog.text
        caplog.clear()


def test_a_checkpoint_with_a_deadline_is_not_made_full_and_says_why(
    scene: Scene, handle: StoreHandle, tmp_path: Path
) -> None:
    checker, _found, reason = scene.found_damaged(handle)
    journal = Journal(tmp_path / "jobs.sqlite")
    executor = JobExecutor(journal)
    decided: dict[str, str | None] = {}

    def body(ctx: JobContext) -> None:
        decided[ctx.job_id] = full_push_reason(checker, "svc", ctx)

    try:
        reclaim = executor.submit(JobKind.CHECKPOINT, "svc", body, deadline=time.time() + 3600)
        operator = executor.submit(JobKind.CHECKPOINT, "svc", body)
        reclaimed = executor.wait_terminal(reclaim.id, HANG_GUARD)
        operated = executor.wait_terminal(operator.id, HANG_GUARD)
    finally:
        executor.shutdown(timeout=HANG_GUARD)
        journal.close()
    assert decided == {reclaim.id: None, operator.id: reason}
    assert reclaimed.result == {"full_deferred": reason}
    assert operated.result == {}
    assert checker.full_reason("svc") == reason  # still due: the next checkpoint is full


def test_a_checkpoint_removed_while_the_check_ran_is_no_damage_and_no_bad_manifest() -> None:
    check = StoreCheck(
        checked_at=1.0,
        seconds=0.5,
        checkpoints=["gone", "kept"],
        missing={"gone": ["c1", "c2"], "kept": ["c2"]},
        chunks_checked=9,
        chunks_missing=2,
        manifests_bad=["vanished: not found", "altered: signature does not verify"],
        not_found=[],
    )
    listed = [ManifestSummary("kept", "svc", 5.0, None, 1, 1)]
    summary = summarize(check, listed, ["altered"])
    assert [d.checkpoint_id for d in summary.damaged] == ["kept"]
    assert summary.chunks_missing == 1 and summary.damaged[0].latest
    assert summary.manifests_bad == ("altered: signature does not verify",)


def test_the_schedule_runs_at_nice_19_and_retries_a_store_it_cannot_reach(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = tmp_path / "k"
    generate_signing_key(key)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    config = _config(
        tmp_path,
        {
            "url": "s3://bucket/p",
            "endpoint_url": closed,
            "region": "us-east-1",
            "key_file": str(key),
            "retry_attempts": 1,
            "connect_timeout": 1,
        },
    )
    (tmp_path / "state").mkdir()
    metrics = MetricsRegistry()
    handle = StoreHandle(config)
    checker = StoreChecker(
        handle,
        interval=0.05,
        state_file=tmp_path / "state" / "store-check.json",
        store_url="s3://bucket/p",
        metrics=metrics,
    )
    caplog.set_level(logging.WARNING, logger="gpusnap.daemon.node.storecheck")
    checker.start()
    try:
        _until(
            "two failed checks", lambda: "gpusnap_store_check_failures_total 2" in metrics.render()
        )
        assert checker.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, checker.native_id) == 19
        status = checker.status()
        assert status["error"] and status["error_at"] is not None
        assert status["last_check_at"] is None and status["next_check_at"] is not None
        assert "store check failed" in caplog.text and "trying again in" in caplog.text
        samples = [line.split()[0] for line in metrics.render().splitlines() if line[0] != "#"]
        assert "gpusnap_store_missing_chunks" not in samples  # no check has run: not known
    finally:
        checker.stop()
        handle.close()
    assert not checker.running


def test_check_interval_zero_starts_no_schedule(scene: Scene, handle: StoreHandle) -> None:
    checker = scene.checker(handle, interval=0)
    checker.start()
    assert not checker.running and checker.native_id is None
    assert checker.status()["next_check_at"] is None
    assert checker.status()["interval_seconds"] == 0


def test_check_interval_in_the_config(tmp_path: Path) -> None:
    key = tmp_path / "k"
    base = {"url": "file:///srv/store", "key_file": str(key)}
    assert _config(tmp_path, base).store.check_interval == DEFAULT_CHECK_INTERVAL == 21600
    assert _config(tmp_path, {**base, "check_interval": 0}).store.check_interval == 0
    assert _config(tmp_path, {**base, "check_interval": 0.5}).store.check_interval == 0.5
    for bad in (-1, "6h", True, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument) as info:
            _config(tmp_path, {**base, "check_interval": bad})
        message = str(info.value)
        assert "[store]" in message and "'check_interval'" in message, message
        assert "\n" not in message


def test_a_manifest_this_node_cannot_authenticate_is_reported_as_not_read(
    scene: Scene, handle: StoreHandle, tmp_path: Path
) -> None:
    stranger = tmp_path / "stranger.key"
    generate_signing_key(stranger)
    tree = tmp_path / "stranger-tree"
    tree.mkdir()
    (tree / "pages-1.img").write_bytes(b"\x01" * 1000)
    with open_store(scene.url, key_file=stranger, cache_dir=tmp_path / "stranger") as store:
        foreign = store.push(tree, workload="svc").checkpoint_id
    found = scene.checker(handle).check_now()
    (bad,) = found.manifests_bad
    assert bad.startswith(f"{foreign}: ") and found.damaged == ()
    assert found.checkpoints_checked == 3  # the three it could read
