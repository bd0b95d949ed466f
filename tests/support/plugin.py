"""The suite's shared fixtures, one pytest plugin (registered in tests/conftest.py).

- ``moto_server``: the one moto S3 server of the run (of each xdist worker), started when a
  test first asks for it; ``s3_bucket``: a fresh bucket on it per test;
- ``proxy``: a ``FaultProxy`` in front of that server;
- ``child_subreaper``: the test process adopts orphans (a kill-mode dump's, a restored
  tree's), so their pids are ours to reap and free for a restore; a folder's conftest turns
  it on for its tests;
- ``started``: workloads a test starts, killed and reaped at the end;
- ``nodes``: real daemons (``tests/support/daemons.py``), stopped at the end;
- stores of each kind, for the storage and security suites: ``store`` (a bare backend),
  ``checkpoint_store`` (a signed checkpoint store on it), ``keys``; file:// and S3 (moto);
- the fake driver (``tests/fakes/libcuda``): ``lib`` (built once), ``spawn`` (CUDA
  processes), ``fake_nodes`` (``FakeNode``) and ``gpu_nodes`` (daemons on fake nodes).

Area fixtures that only one folder uses stay in that folder's conftest.py; no test module
imports a conftest or this plugin: classes and helpers live in ordinary modules.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.storage import CheckpointStore
from gpusnap.storage.open import open_backend
from tests.fakes import libcuda
from tests.fakes.libcuda import CudaProcess, Spawn
from tests.storage.store_helpers import Keys, StoreUnderTest, fast_options, file_store, make_keys
from tests.support import workloads
from tests.support.criu import criu_or_skip
from tests.support.daemons import Nodes
from tests.support.fake_gpu import FakeNode, GpuNodes
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import MotoServer, aws_test_credentials


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """A moto S3 server on 127.0.0.1, with dummy AWS credentials in the environment."""
    with aws_test_credentials(), MotoServer() as server:
        yield server


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> str:
    """A fresh, empty bucket for one test (cheaper than resetting the server)."""
    name = f"gs-{uuid.uuid4().hex[:16]}"
    moto_server.create_bucket(name)
    return name


@pytest.fixture
def proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the suite's moto server."""
    with FaultProxy(moto_server.endpoint_url) as fault_proxy:
        yield fault_proxy


@pytest.fixture(scope="session")
def child_subreaper() -> Iterator[None]:
    """This process adopts the orphans of what it starts, for the rest of the session."""
    workloads.set_child_subreaper(True)
    yield
    workloads.set_child_subreaper(False)


@pytest.fixture
def started() -> Iterator[workloads.Started]:
    """Workloads a test starts; whatever still runs at the end is killed and reaped."""
    s = workloads.Started()
    yield s
    s.kill_all()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    """Real daemons under the test's directory (CRIU and root, or a skip)."""
    criu_or_skip()
    with Nodes(tmp_path) as n:
        yield n


@pytest.fixture(scope="session")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libcuda.so.1, built once per session into a temporary directory."""
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler or make here (scripts/bootstrap.sh installs them)")
    return libcuda.build(tmp_path_factory.mktemp("libcuda"))


def _ptrace_scope() -> int:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return 0


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``spawn(workdir, env, allocs, **kw)``: a started CUDA process, killed at the end."""
    if os.geteuid() != 0 and _ptrace_scope() >= 1:
        pytest.skip("the checkpoint calls need ptrace rights over their target (Yama forbids)")
    procs: list[CudaProcess] = []

    def start(workdir: Path, environ: dict[str, str], allocs: Any, **kw: Any) -> CudaProcess:
        p = CudaProcess.start(workdir, environ, allocs, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


@pytest.fixture
def fake_nodes(lib: Path, tmp_path: Path) -> Callable[..., FakeNode]:
    """``fake_nodes(name, gpus=None, **node_json)``: a ``FakeNode`` under ``tmp_path``."""

    def make(name: str, gpus: list[dict[str, Any]] | None = None, **kw: Any) -> FakeNode:
        return FakeNode(lib, tmp_path / f"node-{name}").write(gpus, **kw)

    return make


@pytest.fixture
def gpu_nodes(tmp_path: Path, lib: Path) -> Iterator[GpuNodes]:
    """Real daemons on fake GPU nodes under the test's directory (CRIU and root, or a skip)."""
    criu_or_skip()
    with GpuNodes(tmp_path, lib) as n:
        yield n


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreUnderTest]:
    """The same suite, once against a directory and once against S3 (moto over HTTP)."""
    if request.param == "file":
        root = tmp_path / "store"
        backend = open_backend(f"file://{root}", fast_options())
        under_test = StoreUnderTest("file", backend, root=root)
    else:
        moto: MotoServer = request.getfixturevalue("moto_server")
        bucket: str = request.getfixturevalue("s3_bucket")
        backend = open_backend(f"s3://{bucket}/ckpt", fast_options(moto.endpoint_url))
        under_test = StoreUnderTest("s3", backend, bucket=bucket, prefix="ckpt/", moto=moto)
    try:
        yield under_test
    finally:
        backend.close()


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return make_keys(tmp_path / "keys")


@pytest.fixture(params=["file", "s3"])
def checkpoint_store(
    request: pytest.FixtureRequest, tmp_path: Path, keys: Keys
) -> Iterator[CheckpointStore]:
    """A checkpoint store with a signing key, on a directory and on S3 (moto over HTTP)."""
    if request.param == "file":
        opened = file_store(tmp_path, keys)
    else:
        moto: MotoServer = request.getfixturevalue("moto_server")
        bucket: str = request.getfixturevalue("s3_bucket")
        opened = file_store(
            tmp_path, keys, url=f"s3://{bucket}/ckpt", options=fast_options(moto.endpoint_url)
        )
    try:
        yield opened
    finally:
        opened.close()
