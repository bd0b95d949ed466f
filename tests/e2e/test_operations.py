"""What an operator sees and does around jobs, through the real daemon: status and workloads
with the last good checkpoint, the Prometheus endpoint, the mutual-TLS listener, cancel."""

from __future__ import annotations

import contextlib
import os
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpusnap.cli._client import DaemonClient
from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.criu import Criu
from tests.support import workloads
from tests.support.daemons import HANG_GUARD, Node, Nodes, restored_cleanup
from tests.support.faultproxy import GateProxy
from tests.support.moto_server import TEST_REGION, MotoServer
from tests.support.tls import Ca, free_port
from tests.support.workloads import Started

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]


def _until(what: str, ready: Callable[[], bool]) -> None:
    end = time.monotonic() + HANG_GUARD
    while not ready():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.05)


# --- status, workloads, metrics -----------------------------------------------------------------


def test_status_workloads_and_metrics_show_the_last_good_checkpoint_and_its_age(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path / "run", steps=0))
    pid_file = tmp_path / "svc.pid"
    pid_file.write_text(f"{w.pid}\n")
    port = free_port()
    node = nodes.make(
        "a",
        extra_config=(
            f'[[workload]]\nname = "svc"\npid_file = "{pid_file}"\n\n'
            f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
        ),
    ).start()

    before = node.cli("status", "--json")
    assert before.rc == 0, before.stderr
    status = before.json
    assert status["workloads"] == [
        {
            "name": "svc",
            "last_checkpoint_id": None,
            "last_checkpoint_at": None,
            "last_checkpoint_age_seconds": None,
            "warm": None,  # no checkpoint yet: nothing to be warm of
        }
    ]
    caps = status["capabilities"]
    assert re.match(r"criu 4\.\d+\.\d+ at /", caps["criu"]), caps
    # The CRIU section: the binary the daemon uses, and whether it dumps TCP here.
    criu = Criu()
    support = criu.tcp_support()
    assert status["criu"] == {
        "path": str(criu.path),
        "version": ".".join(str(n) for n in criu.version()),
        "error": None,
        "tcp_dump": support.ok,
        "tcp_dump_reason": support.why,
        "kernel": os.uname().release,
    }
    assert caps["store"] == "reachable"
    assert "GPU support is off" in caps["gpu"]

    w.wait_steps(3)
    ck = node.cli("checkpoint", "--workload", "svc", "--leave-running", "--wait", "--json")
    assert ck.rc == 0, ck.stderr + node.log()
    checkpoint_id = ck.json["checkpoint_id"]

    after = node.cli("status", "--json").json
    (entry,) = after["workloads"]
    assert entry["last_checkpoint_id"] == checkpoint_id
    assert 0 <= entry["last_checkpoint_age_seconds"] < HANG_GUARD
    # What this node pushed its chunk cache holds ([cache] seed): all of it warm here.
    assert entry["warm"]["checkpoint_id"] == checkpoint_id and entry["warm"]["fraction"] == 1.0
    listed = node.cli("workloads", "--json")
    assert listed.rc == 0, listed.stderr
    (wl,) = listed.json["workloads"]
    assert wl["name"] == "svc" and wl["pid"] == w.pid and wl["running"] is True
    assert wl["last_checkpoint_id"] == checkpoint_id
    assert wl["last_checkpoint_age_seconds"] >= 0
    text = node.cli("workloads")
    assert text.rc == 0 and checkpoint_id in text.stdout, text.stdout
    human = node.cli("status")
    assert human.rc == 0 and "criu: criu 4." in human.stdout and checkpoint_id in human.stdout

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        body = response.read().decode()
    labels = 'kind="checkpoint",outcome="succeeded"'
    assert f"gpusnap_jobs_total{{{labels}}} 1" in body
    assert f"gpusnap_job_duration_seconds_count{{{labels}}} 1" in body
    duration = re.search(rf"gpusnap_job_duration_seconds_sum{{{labels}}} (\S+)", body)
    assert duration is not None and float(duration[1]) > 0
    uploaded = re.search(r'gpusnap_bytes_uploaded_total\{kind="checkpoint"\} (\d+)', body)
    assert uploaded is not None and int(uploaded[1]) == ck.json["bytes_uploaded"] > 0
    total = re.search(r'gpusnap_bytes_total\{kind="checkpoint"\} (\d+)', body)
    assert total is not None and int(total[1]) == ck.json["bytes_total"]
    age = re.search(r'gpusnap_last_checkpoint_age_seconds\{workload="svc"\} (\S+)', body)
    assert age is not None and 0 <= float(age[1]) < HANG_GUARD


# --- the mutual-TLS listener ------------------------------------------------------------------


def test_the_tcp_listener_takes_a_client_cert_of_the_client_ca_and_refuses_others(
    nodes: Nodes, tmp_path: Path
) -> None:
    server_ca, client_ca, stranger_ca = Ca("server CA"), Ca("client CA"), Ca("other CA")
    server_cert, server_key = server_ca.leaf("gpusnapd", ExtendedKeyUsageOID.SERVER_AUTH)
    client_cert, client_key = client_ca.leaf("operator", ExtendedKeyUsageOID.CLIENT_AUTH)
    stranger_cert, stranger_key = stranger_ca.leaf("intruder", ExtendedKeyUsageOID.CLIENT_AUTH)
    tls = tmp_path / "tls"
    tls.mkdir()
    for name, data in {
        "server.pem": server_cert,
        "server.key": server_key,
        "clients-ca.pem": client_ca.pem,
    }.items():
        (tls / name).write_bytes(data)
    address = f"127.0.0.1:{free_port()}"
    node = nodes.make("a")
    node.write_config()
    text = node.config_path.read_text()
    node.config_path.write_text(
        text.replace(
            "\n[store]\n",
            f'\n[daemon.tcp]\nlisten = "{address}"\ncert_file = "{tls / "server.pem"}"\n'
            f'key_file = "{tls / "server.key"}"\nclient_ca_file = "{tls / "clients-ca.pem"}"\n'
            "\n[store]\n",
            1,
        )
    )
    node.start()

    def client(cert: bytes | None, key: bytes | None) -> DaemonClient:
        creds = grpc.ssl_channel_credentials(
            root_certificates=server_ca.pem, private_key=key, certificate_chain=cert
        )
        return DaemonClient(address, credentials=creds, timeout=30)

    status = client(client_cert, client_key).status()
    assert status["node_id"] == "a"
    assert node.proc is not None and status["pid"] == node.proc.pid

    for cert, key in ((None, None), (stranger_cert, stranger_key)):
        with pytest.raises(Exception) as refused:  # the handshake fails; which error varies
            client(cert, key).status()
        assert "node_id" not in str(refused.value)
    with pytest.raises(Exception):
        DaemonClient(address, timeout=30).status()  # plaintext to the TLS port


# --- cancel -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _s3_node(
    nodes: Nodes,
    moto: MotoServer,
    bucket: str,
    name: str,
    *,
    daemon_extra: str = "",
    extra_config: str = "",
) -> Iterator[tuple[Node, GateProxy]]:
    """A node on S3 through a proxy that can hold chunk transfers (GET and PUT)."""
    with GateProxy(moto.endpoint_url) as proxy:
        node = nodes.make(name, extra_config=extra_config, daemon_config=daemon_extra)
        try:
            node.write_config(
                store_section=(
                    f'url = "s3://{bucket}/gpusnap"\n'
                    f'endpoint_url = "{proxy.endpoint_url}"\n'
                    f'region = "{TEST_REGION}"\n'
                    f'key_file = "{nodes.key_file}"\n'
                )
            )
            node.start()
            yield node, proxy
        finally:
            proxy.gate.set()
            node.stop()


def test_cancel_of_a_queued_checkpoint_ends_it_at_once_and_never_touches_its_workload(
    nodes: Nodes, moto_server: MotoServer, s3_bucket: str, tmp_path: Path, started: Started
) -> None:
    config = ""
    for name in ("first", "second"):
        w = started(workloads.start_counter(tmp_path / name, steps=0))
        (tmp_path / f"{name}.pid").write_text(f"{w.pid}\n")
        config += f'[[workload]]\nname = "{name}"\npid_file = "{tmp_path / name}.pid"\n\n'
    first, second = started.workloads
    first.wait_steps(3)
    second.wait_steps(3)
    # One job at a time: the second checkpoint waits while the first is held mid-upload.
    with _s3_node(
        nodes, moto_server, s3_bucket, "a", daemon_extra="max_jobs = 1\n", extra_config=config
    ) as (node, proxy):
        proxy.gate.clear()
        running = node.cli("checkpoint", "--workload", "first", "--leave-running", "--json")
        assert running.rc == 0, running.stderr
        running_id = running.json["id"]
        _until("the first upload to reach the store", lambda: proxy.held > 0)
        queued = node.cli("checkpoint", "--workload", "second", "--leave-running", "--json")
        assert queued.rc == 0, queued.stderr
        queued_id = queued.json["id"]
        assert node.job(queued_id)["state"] == "queued"

        cancel = node.cli("cancel", queued_id, "--json")
        assert cancel.rc == 0, cancel.stderr
        _until("the queued job to end", lambda: node.job(queued_id)["state"] != "queued")
        assert node.job(queued_id)["state"] == "cancelled"
        assert node.job(running_id)["state"] == "running"  # still held at the gate

        proxy.gate.set()
        _until("the first checkpoint to end", lambda: node.job(running_id)["state"] != "running")
        assert node.job(running_id)["state"] == "succeeded"
        listed = node.cli("ls", "--json").json["checkpoints"]
        assert [c["workload"] for c in listed] == ["first"]
        at = second.steps_done()
        second.wait_steps(at + 3)  # never frozen, never dumped


def test_cancel_of_a_running_restore_stops_it_before_any_process_is_restored(
    nodes: Nodes, moto_server: MotoServer, s3_bucket: str, tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    # Without [cache] seed the checkpoint is not in this node's cache: the restore must fetch.
    no_seed = "[cache]\nseed = false\n"
    with _s3_node(nodes, moto_server, s3_bucket, "a", extra_config=no_seed) as (node, proxy):
        ck = node.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
        assert ck.rc == 0, ck.stderr + node.log()
        w.reap()  # kill mode: gone, its pid free for a restore
        assert not proctree.exists(w.pid)

        proxy.gate.clear()
        restore = node.cli("restore", ck.json["checkpoint_id"], "--json")
        assert restore.rc == 0, restore.stderr
        job_id = restore.json["id"]
        _until("the restore to fetch chunks", lambda: proxy.held > 0)
        assert node.job(job_id)["phase"] == "fetch"

        cancel = node.cli("cancel", job_id, "--json")
        assert cancel.rc == 0, cancel.stderr
        proxy.gate.set()
        _until("the restore to end", lambda: node.job(job_id)["state"] not in ("running",))
        job = node.job(job_id)
        assert job["state"] == "cancelled", job
        assert not proctree.exists(w.pid)  # nothing was restored
        assert not list((node.state_dir / "staging").iterdir())  # and nothing left behind
        again = node.cli("cancel", job_id)
        assert again.rc != 0 and "already cancelled" in again.stderr


# --- staging ------------------------------------------------------------------------------------


def test_a_configured_staging_dir_is_used_and_only_job_leftovers_are_cleaned_there(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    staging = tmp_path / "fast" / "staging"
    leftover = staging / "20260101T000000-abcdef"  # named like a job: a crashed job's images
    (leftover / "images").mkdir(parents=True)
    foreign = staging / "not-a-job"
    foreign.mkdir()
    node = nodes.make("a")
    node.write_config()
    text = node.config_path.read_text()
    node.config_path.write_text(
        text.replace('node_id = "a"\n', f'node_id = "a"\nstaging_dir = "{staging}"\n', 1)
    )
    node.start()
    assert not leftover.exists()
    assert foreign.is_dir()
    assert node.cli("status", "--json").json["staging_dir"] == str(staging)
    assert not (node.state_dir / "staging").exists()

    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    ck = node.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc == 0, ck.stderr + node.log()
    w.reap()
    rs = node.cli("restore", ck.json["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + node.log()
    try:
        assert rs.json["mode"] == "restored"
        assert rs.json["criu_pages_restored"] > 0
        assert [p.name for p in staging.iterdir()] == ["not-a-job"]
        at = w.steps_done()
        w.wait_steps(at + 3)
    finally:
        restored_cleanup(rs.json["pids"])
