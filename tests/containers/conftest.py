"""Fixtures for the container tests: two podman storage roots ("node A" and "node B") on this
machine, each with the test image loaded (``harness.py``), and real daemons reaching them.

The roots live for the session (loading the image costs seconds); each test names its
containers uniquely and removes them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.harness import Node, make_node, teardown
from tests.containers.image import image_archive
from tests.support.criu import criu_or_skip
from tests.support.daemons import Nodes as Daemons


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "container checkpoints need root"
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} missing: run scripts/install-containers.sh"
    if not Path("/usr/local/sbin/criu").exists():
        return "CRIU missing: run scripts/install-criu.sh"
    return None


@pytest.hookimpl(tryfirst=True)  # marked before ``-m`` deselects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder drives real CRIU and is slow (``criu``, ``slow``); all of them
    are skipped, with the reason, where the runtimes or CRIU are missing."""
    reason = _skip_reason()
    for item in items:
        if not Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            continue
        item.add_marker(pytest.mark.criu)
        item.add_marker(pytest.mark.slow)
        # One xdist worker runs them all: the session's podman roots (the image loaded into
        # two roots) and each module's containerd are made once, not once per worker, and
        # the containerd of test_containerd.py runs its containers under one fixed namespace.
        item.add_marker(pytest.mark.xdist_group("containers"))
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def image() -> Path:
    return image_archive()


@pytest.fixture(scope="session")
def nodes(tmp_path_factory: pytest.TempPathFactory, image: Path) -> Iterator[tuple[Node, Node]]:
    base = tmp_path_factory.mktemp("podman-nodes")
    a = make_node(base, "a", image)
    b = make_node(base, "b", image)
    try:
        yield a, b
    finally:
        teardown(a)
        teardown(b)


@pytest.fixture
def node_a(nodes: tuple[Node, Node]) -> Node:
    return nodes[0]


@pytest.fixture
def node_b(nodes: tuple[Node, Node]) -> Node:
    return nodes[1]


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    """Real gpusnapd daemons (tests/containers/daemons.py), stopped at the end."""
    criu_or_skip()
    # A short base: the daemons' sockets must stay within a unix socket path's 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="gpusnap-d-", dir="/tmp"))
    try:
        with Daemons(base) as d:
            yield d
    finally:
        shutil.rmtree(base, ignore_errors=True)
