"""A checkpoint's progress as the daemon reports it over ``Jobs.Watch``: true totals in each
phase (the upload's is the whole checkpoint, not the few files the push still reads after the
page images went up during the dump), and a finished job keeps its figures."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.cli._client import DaemonClient
from tests.support import workloads
from tests.support.daemons import Nodes

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(300)]

HOLDER = Path(__file__).with_name("memory_holder.py")
MIB = 1 << 20


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    ready = tmp_path / "holder.ready"
    proc = subprocess.Popen(
        [sys.executable, str(HOLDER), "--mib", "256", "--ready", str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    workloads._poll(lambda: ready.exists() or proc.poll() is not None, 120, "the holder")
    yield proc
    proc.kill()
    proc.wait()


def test_a_first_checkpoint_reports_the_whole_checkpoint_in_each_phase(
    nodes: Nodes, holder: subprocess.Popen[bytes]
) -> None:
    node = nodes.make("a").start()  # upload_during_dump: the page images go up while dumped
    with DaemonClient.for_socket(node.socket) as client:
        job = client.checkpoint(pid=holder.pid, leave_running=True)
        seen = list(client.watch_job(job["id"]))
        final = client.get_job(job["id"])
    assert final["state"] == "succeeded", final
    result = final["result"]
    whole = result["bytes_total"]
    assert whole >= 128 * MIB  # the holder's pages (its untouched zeros are not dumped)
    assert result["bytes_uploaded"] > 64 * MIB  # mostly during the dump, by the streamer
    with_bytes = [s for s in seen if s["bytes_total"] > 0 and s["state"] == "running"]
    assert with_bytes, [(s["phase"], s["bytes_done"], s["bytes_total"]) for s in seen]
    for s in with_bytes:
        assert s["phase"] in ("dump", "upload"), s
        assert s["bytes_done"] <= s["bytes_total"], s
        if s["phase"] == "upload":
            assert s["bytes_total"] == whole, s  # never the push's few KiB
        else:  # the tree's memory, read before CRIU starts, then what CRIU wrote
            assert s["bytes_total"] >= whole // 2, s
    assert (final["bytes_done"], final["bytes_total"]) == (whole, whole)
    listed = next(j for j in node.cli("jobs", "--json").json["jobs"] if j["id"] == job["id"])
    assert (listed["bytes_done"], listed["bytes_total"]) == (whole, whole)
