"""A kill-mode checkpoint whose upload fails: the daemon brings the workload back on this node
from its local images, GPU state included (the fake CUDA driver stands in for the GPU)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpusnap.daemon.host import proctree
from tests.e2e.conftest import restored_cleanup
from tests.e2e_gpu.conftest import GpuNodes
from tests.fakes.fake_cuda import GIB, default_devices
from tests.support import workloads
from tests.support.criu import criu_or_skip
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import TEST_REGION, MotoServer

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_failed_upload_after_a_kill_mode_dump_restores_the_workload_and_its_gpu_state(
    tmp_path: Path, moto_server: MotoServer, s3_bucket: str
) -> None:
    criu_or_skip()
    gpu_nodes = GpuNodes(tmp_path)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        node, fake = gpu_nodes.make_gpu("a")
        text = node.config_path.read_text()
        node.config_path.write_text(
            text.replace(
                f'url = "{node.store_url}"\n',
                f'url = "s3://{s3_bucket}/gpusnap"\n'
                f'endpoint_url = "{proxy.endpoint_url}"\n'
                f'region = "{TEST_REGION}"\n'
                "retry_attempts = 1\n",
            )
        )
        node.start()
        w = workloads.start_counter(tmp_path / "run", steps=0)
        pid = w.pid
        try:
            w.wait_steps(3)
            fake.add_process(pid, {default_devices()[0]["uuid"]: 2 * GIB})
            # The dump kills the workload; reap it at once (as its real parent would) so that
            # its pid is free for the daemon's local restore.
            reaper = threading.Thread(target=w.reap, daemon=True)
            reaper.start()
            proxy.fail_next(10**6, status=500, match="PUT ")  # reads work, every write fails

            ck = node.cli("checkpoint", "--pid", str(pid), "--wait", "--json")
            reaper.join(60)

            assert ck.rc == 1, ck.stdout + ck.stderr
            assert ck.json["state"] == "failed"
            assert "restored on this node from the local dump" in ck.json["error"], ck.json
            assert "with its GPU state" in ck.json["error"], ck.json
            assert "failed" in proxy.outcomes()
            assert proctree.exists(pid)  # CRIU restored it with its pid
            # The GPU side went lock, checkpoint (the dump), then restore, unlock (the rescue).
            assert fake.calls("lock", "checkpoint", "restore", "unlock") == [
                ("lock", pid),
                ("checkpoint", pid),
                ("restore", pid),
                ("unlock", pid),
            ]
            assert fake.state_of(pid) == "RUNNING"
            at = w.steps_done()
            w.wait_steps(at + 3)  # and it runs on
        finally:
            gpu_nodes.close()
            restored_cleanup([pid])
            w.kill()
