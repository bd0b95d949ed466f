"""The daemon's background store check through the real daemon (issue 12 §3): a chunk lost
behind the store's back is found by the schedule, shown by ``gpusnap status`` and the metrics,
logged loudly, and makes the workload's next checkpoint a full one, after which the store
verifies clean and the checkpoint restores exactly; ``check_interval = 0`` runs no check; an
unreachable store is logged and retried while the daemon serves on."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpusnap.storage.layout import chunk_key
from tests.e2e.store_reading import StoreReader, store_check, until
from tests.support import workloads
from tests.support.daemon_config import workload_section
from tests.support.daemons import Node, Nodes, restored_cleanup
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import TEST_REGION, MotoServer
from tests.support.tls import free_port
from tests.support.workloads import Started

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        body: str = response.read().decode()
    return body


def _checkpoint(node: Node, *args: str) -> dict[str, Any]:
    ck = node.cli("checkpoint", "--workload", "svc", *args, "--wait", "--json")
    assert ck.rc == 0, ck.stderr + node.log()
    result: dict[str, Any] = ck.json
    return result


def test_a_lost_chunk_is_found_shown_and_repaired_by_a_full_next_checkpoint(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    pid_file = tmp_path / "svc.pid"
    pid_file.write_text(f"{w.pid}\n")
    port = free_port()
    metrics = f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
    node = nodes.make("a", extra_config=workload_section("svc", pid_file) + metrics)
    store_url = node.store_url
    node.write_config(
        store_section=f'url = "{store_url}"\nkey_file = "{nodes.key_file}"\ncheck_interval = 0.5\n'
    )
    node.start()
    first = _checkpoint(node, "--leave-running")
    latest = _checkpoint(node, "--leave-running")
    assert latest["parent"] == first["checkpoint_id"] and latest["full"] is False
    reader = StoreReader(store_url, nodes.key_file, tmp_path / "reader-cache")
    in_first = reader.chunks(first["checkpoint_id"])
    in_latest = reader.chunks(latest["checkpoint_id"])
    # A chunk both checkpoints name, of an image the next dump writes the same (the process
    # tree: same pids, same threads), so the full checkpoint puts it back and every
    # checkpoint naming it is whole again. (The counter's pages change at every step.)
    (lost,) = [c for c, path in in_latest.items() if c in in_first and path == "pstree.img"]
    (nodes.store_dir / chunk_key(lost)).unlink()  # behind the store's back: an operator's rm
    lost_at = time.time()

    check = until(
        "a check to find the lost chunk",
        lambda: (
            (c := store_check(node))["last_check_at"] is not None
            and c["last_check_at"] > lost_at
            and c
        ),
        node,
    )
    damaged = {d["checkpoint_id"]: d for d in check["damaged"]}
    assert damaged == {
        first["checkpoint_id"]: {
            "checkpoint_id": first["checkpoint_id"],
            "workload": "svc",
            "missing_chunks": 1,
            "latest": False,
        },
        latest["checkpoint_id"]: {
            "checkpoint_id": latest["checkpoint_id"],
            "workload": "svc",
            "missing_chunks": 1,
            "latest": True,
        },
    }, check
    assert check["chunks_missing"] == 1 and check["error"] is None
    assert latest["checkpoint_id"] in check["full_next"]["svc"]
    assert check["interval_seconds"] == 0.5 and check["next_check_at"] is not None
    body = _metrics(port)
    assert "gpusnap_store_missing_chunks 1\n" in body
    assert "gpusnap_store_damaged_checkpoints 2\n" in body
    assert re.search(r"^gpusnap_store_last_check_timestamp_seconds \S+$", body, re.M), body
    log = node.log_path.read_text()
    assert re.search(
        rf"ERROR gpusnap\.daemon\.node\.storecheck: .*checkpoint {latest['checkpoint_id']} "
        r"of workload svc is DAMAGED: 1 chunk\(s\)",
        log,
    ), log[-4000:]
    human = node.cli("status")
    assert human.rc == 0 and "DAMAGED CHECKPOINT" in human.stdout, human.stdout
    assert latest["checkpoint_id"] in human.stdout and "next checkpoint of svc is a full one" in (
        human.stdout
    )

    # The next checkpoint (kill mode: it is what a restore brings back) uploads every chunk.
    w.wait_steps(w.steps_done() + 3)
    full = _checkpoint(node)
    assert full["full"] is True and latest["checkpoint_id"] in full["full_reason"], full
    assert full["parent"] == latest["checkpoint_id"]
    assert full["chunks_uploaded"] > latest["chunks_uploaded"]
    w.reap()
    assert lost in reader.chunks(full["checkpoint_id"])
    # Its page images went up while CRIU wrote them, as a first checkpoint's do.
    assert "criu-pages" in reader.stream_kinds(full["checkpoint_id"])
    assert "criu-pages" not in reader.stream_kinds(latest["checkpoint_id"])
    committed_at = time.time()

    clean = until(
        "a check after the full checkpoint",
        lambda: (c := store_check(node))["last_check_at"] > committed_at and c,
        node,
    )
    assert clean["damaged"] == [] and clean["chunks_missing"] == 0, clean
    assert clean["full_next"] == {}
    assert "gpusnap_store_missing_chunks 0\n" in _metrics(port)
    verify = reader.verify_all(node)
    assert verify.rc == 0, verify.stdout + verify.stderr

    rs = node.cli("restore", full["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + node.log()
    pids = rs.json["pids"]
    try:
        assert rs.json["mode"] == "restored", rs.json["reasons"]
        assert pids[0] == w.pid
        at_restore = w.steps_done()
        w.wait_steps(at_restore + 5)
        out = w.output()
        lines = out[: out.rfind(b"\n") + 1]
        n = lines.count(b"\n")
        # The hash chain continued from the restored memory, byte for byte.
        assert lines == workloads.expected_lines("counter", n)[: -len(workloads.DONE)]
    finally:
        restored_cleanup(pids)


def test_check_interval_zero_runs_no_check(nodes: Nodes, tmp_path: Path, started: Started) -> None:
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    port = free_port()
    node = nodes.make("a", extra_config=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    node.write_config(
        store_section=(
            f'url = "{node.store_url}"\nkey_file = "{nodes.key_file}"\ncheck_interval = 0\n'
        )
    )
    node.start()
    ck = node.cli("checkpoint", "--pid", str(w.pid), "--leave-running", "--wait", "--json")
    assert ck.rc == 0, ck.stderr
    for chunk in (nodes.store_dir / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.unlink()  # every chunk gone: any check would have to say so
    status = node.cli("status", "--json")
    assert status.rc == 0, status.stderr
    check = status.json["store_check"]
    assert check["interval_seconds"] == 0
    assert check["last_check_at"] is None and check["next_check_at"] is None, check
    assert check["damaged"] == [] and check["error"] is None
    samples = [line.split()[0] for line in _metrics(port).splitlines() if line[:1] != "#"]
    assert "gpusnap_store_last_check_timestamp_seconds" not in samples
    assert "store check off ([store] check_interval = 0)" in node.log_path.read_text()
    assert "store check:" not in node.log_path.read_text()
    assert "store check: off; none yet" in node.cli("status").stdout


def test_an_unreachable_store_fails_the_check_loudly_and_the_next_one_succeeds(
    nodes: Nodes, moto_server: MotoServer, s3_bucket: str
) -> None:
    with FaultProxy(moto_server.endpoint_url) as proxy:
        node = nodes.make("a")
        node.write_config(
            store_section=(
                f'url = "s3://{s3_bucket}/gpusnap"\n'
                f'endpoint_url = "{proxy.endpoint_url}"\n'
                f'region = "{TEST_REGION}"\n'
                f'key_file = "{nodes.key_file}"\n'
                "check_interval = 0.5\n"
                "retry_attempts = 1\n"
                "connect_timeout = 2\n"
            )
        )
        node.start()
        good = until("a first check", lambda: (c := store_check(node))["last_check_at"] and c, node)
        proxy.go_down()
        down_at = time.time()
        failed = until(
            "a check against the unreachable store",
            lambda: (c := store_check(node))["error"] and c["error_at"] > down_at and c,
            node,
        )
        assert failed["last_check_at"] >= good["last_check_at"]  # the last good one stays
        assert "WARNING gpusnap.daemon.node.storecheck: store check failed: " in (
            node.log_path.read_text()
        )
        # The daemon serves on: status, jobs, and the store's own error for what needs it.
        assert node.cli("jobs", "--json").rc == 0
        listed = node.cli("ls")
        assert listed.rc != 0 and "\n" not in listed.stderr.strip(), listed.stderr
        proxy.go_up()
        back = until(
            "a check once the store is back",
            lambda: (
                (c := store_check(node))["error"] is None
                and c["last_check_at"] > failed["error_at"]
                and c
            ),
            node,
        )
        assert back["damaged"] == [] and back["chunks_missing"] == 0
        assert node.stop() == 0
