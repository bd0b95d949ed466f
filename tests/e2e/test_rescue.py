"""A kill-mode checkpoint whose upload fails: the daemon brings the workload back on this node
from its local images, GPU state included (the fake libcuda stands in for the GPU)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpusnap.daemon.host import proctree
from tests.fakes.libcuda import GIB, MIB
from tests.gpu.lm import start_device_lm
from tests.support.daemons import restored_cleanup
from tests.support.fake_gpu import GpuNodes
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import TEST_REGION

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_failed_upload_after_a_kill_mode_dump_restores_the_workload_and_its_gpu_state(
    tmp_path: Path, gpu_nodes: GpuNodes, proxy: FaultProxy, s3_bucket: str
) -> None:
    on_a = gpu_nodes.make_gpu("a")
    node, fake = on_a.node, on_a.fake
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
    w = start_device_lm(fake.env, tmp_path / "run", "--interval", "0.05", steps=0)
    pid = w.pid
    try:
        w.wait_steps(3)
        assert fake.free() == 141 * GIB - 5 * MIB  # its weights and KV pool
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
        # Its device memory is back on its GPU, and it runs on from there.
        assert fake.state(pid) == "RUNNING"
        assert fake.free() == 141 * GIB - 5 * MIB
        at = w.steps_done()
        w.wait_steps(at + 3)
    finally:
        gpu_nodes.close()
        restored_cleanup([pid])
        w.kill()
