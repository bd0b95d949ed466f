"""Fixtures of the reclaim tests (``cluster.py``): the workload every node has, and the nodes
over one moto S3 bucket. The test process adopts the orphans of what it starts, as in
tests/e2e.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_reclaim.cluster import LONG_RUN_STEPS, Cluster, ReclaimWorkload, cluster_of
from tests.support import workloads
from tests.support.moto_server import MotoServer


@pytest.fixture(autouse=True)
def _adopt_orphans(child_subreaper: None) -> None:
    """Every test here runs as the orphans' subreaper (``child_subreaper``)."""


@pytest.fixture
def workload(tmp_path: Path) -> Iterator[ReclaimWorkload]:
    w = workloads.start_tree(tmp_path / "run", steps=LONG_RUN_STEPS)
    pid_file = tmp_path / "run" / "tree.pid"
    pid_file.write_text(f"{w.pid}\n")
    rw = ReclaimWorkload(w, pid_file)
    try:
        w.wait_steps(5)
        yield rw
    finally:
        if rw._reaper is None:
            with contextlib.suppress(Exception):
                w.kill()
        rw.kill_restored()
        if not rw.reaped.is_set():
            with contextlib.suppress(Exception):
                w.kill()


@pytest.fixture
def cluster(
    tmp_path: Path, moto_server: MotoServer, s3_bucket: str, workload: ReclaimWorkload
) -> Iterator[Cluster]:
    # Depends on ``workload`` so that the nodes stop before the workload fixture cleans up:
    # a restore still in flight then finishes first, and its tree is ours to kill and reap.
    with cluster_of(tmp_path, moto_server, s3_bucket) as cluster:
        yield cluster
