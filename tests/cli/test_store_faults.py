"""Faults on the way to S3, end to end through the CLI: a moto server behind a FaultProxy.

Transient 5xx answers are retried with backoff; a store that goes away gets one clear line
and exit 1; in no case is a partial checkpoint committed.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli._cli import GPUSNAP, Cli, make_cli, tree_of
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import MotoServer

MiB = 1024 * 1024

pytestmark = pytest.mark.s3


def _s3_cli(tmp_path: Path, endpoint: str, bucket: str) -> Cli:
    return make_cli(
        tmp_path,
        store_url=f"s3://{bucket}/ckpt",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )


def _image(root: Path, mib: int) -> Path:
    rng = random.Random(mib)
    root.mkdir(parents=True)
    for i in range(4):
        (root / f"pages-{i}.img").write_bytes(rng.randbytes(mib * MiB // 4))
    return root


def _start_push(cli: Cli, image: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*GPUSNAP, "store", "push", str(image), "--workload", "faulty", "--json"],
        env=cli.environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_uploads(proxy: FaultProxy, proc: subprocess.Popen[str], count: int) -> None:
    """Block until the push has sent ``count`` chunk PUTs through the proxy (or has ended)."""
    while proc.poll() is None:
        puts = [
            r
            for r in list(proxy.requests)
            if r[0] == "PUT" and "/chunks/" in r[1] and r[2] == "forwarded"
        ]
        if len(puts) >= count:
            return
        time.sleep(0.005)


def _push_under_way(
    tmp_path: Path, bucket: str, proxy: FaultProxy
) -> tuple[Cli, Path, subprocess.Popen[str]]:
    """A push of a 48 MiB image through ``proxy``, two uploads in: the CLI, the image, the push."""
    cli = _s3_cli(tmp_path, proxy.endpoint_url, bucket)
    image = _image(tmp_path / "image", 48)
    proc = _start_push(cli, image)
    _wait_for_uploads(proxy, proc, 2)
    return cli, image, proc


def test_push_survives_503s_for_a_few_seconds(
    tmp_path: Path, s3_bucket: str, proxy: FaultProxy
) -> None:
    cli, image, proc = _push_under_way(tmp_path, s3_bucket, proxy)
    proxy.fail_for(2.0, status=503)
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in err
    assert proc.returncode == 0, err
    assert "failed" in proxy.outcomes(), "the fault window never hit the push"
    checkpoint_id = cli.ids()[0]
    assert checkpoint_id in out
    cli.ok("store", "verify", "--all", "--read-data")
    dest = tmp_path / "dest"
    cli.ok("store", "pull", checkpoint_id, str(dest))
    assert tree_of(dest) == tree_of(image)


@pytest.mark.slow
def test_push_to_a_server_that_stops_fails_cleanly_and_a_retry_succeeds(
    tmp_path: Path, s3_bucket: str, proxy: FaultProxy
) -> None:
    cli, image, proc = _push_under_way(tmp_path, s3_bucket, proxy)
    proxy.go_down()
    out, err = proc.communicate(timeout=600)
    assert "Traceback" not in err
    assert proc.returncode == 1, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("gpusnap: error: ")

    proxy.go_up()
    assert cli.ids() == [], "a failed push must not leave a checkpoint"
    cli.ok("store", "verify", "--all")
    retried = cli.push(image, "faulty")
    assert retried["chunks_uploaded"] < retried["chunks_total"], "nothing was reused"
    assert cli.ids() == [retried["checkpoint_id"]]
    dest = tmp_path / "dest"
    cli.ok("store", "pull", retried["checkpoint_id"], str(dest))
    assert tree_of(dest) == tree_of(image)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_unreachable_store_is_one_line_and_exit_1(
    tmp_path: Path, moto_server: MotoServer, s3_bucket: str
) -> None:
    cli = _s3_cli(tmp_path, moto_server.endpoint_url, s3_bucket)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    image = _image(tmp_path / "image", 1)
    for argv in (
        ["store", "ls"],
        ["store", "push", str(image), "--workload", "w"],
        ["store", "ls", "--json"],
    ):
        result = cli(*argv, "--endpoint-url", endpoint, "--retry-for", "2s")
        assert result.rc == 1, str(result)
        assert len(result.err.strip().splitlines()) == 1, str(result)
        assert result.err.startswith("gpusnap: error: ")
    # The default retry window (30 s) ends the same way, just later.
    default = cli("store", "ls", "--json", "--endpoint-url", endpoint)
    assert default.rc == 1
    assert default.json()["kind"] == "unavailable"
