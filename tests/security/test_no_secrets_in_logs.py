"""Debug output never carries a credential: ``gpusnap -vv`` and ``gpusnapd --log-level debug``
against the suite's moto S3 server with a session token, the way an operator runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cli._cli import make_cli, write_tree
from tests.support.daemons import Nodes
from tests.support.moto_server import TEST_REGION, MotoServer

SECRET_KEY = "SECRETaccessKEY0123456789abcdefghij"
SESSION_TOKEN = "FwoGZXIvYXdzSESSIONtoken0123456789+/="
SECRETS = (SECRET_KEY, SESSION_TOKEN, SESSION_TOKEN[:20])
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIATESTTESTTEST",
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_SESSION_TOKEN": SESSION_TOKEN,
    "AWS_DEFAULT_REGION": TEST_REGION,
}


def assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked:\n{text[-3000:]}"
    assert "Signature=" not in text or "Signature=<redacted>" in text


def test_gpusnap_vv_against_s3_prints_no_credential(
    moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    cli = make_cli(tmp_path, store_url=f"s3://{s3_bucket}/p")
    image = tmp_path / "image"
    write_tree(image, big=64 * 1024)
    env = {**os.environ, **cli.env, **CREDENTIALS}
    for args in (
        ("store", "push", str(image), "--workload", "w"),
        ("store", "ls"),
    ):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpusnap.cli.main",
                *args,
                "-vv",
                "--endpoint-url",
                moto_server.endpoint_url,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        # The debug output is there (requests and their headers are logged) ...
        assert "botocore" in proc.stderr and "X-Amz-Security-Token" in proc.stderr
        # ... without the values.
        assert_clean(proc.stderr)


def test_gpusnapd_debug_log_against_s3_carries_no_credential(
    nodes: Nodes, moto_server: MotoServer, s3_bucket: str
) -> None:
    node = nodes.make("a", store_url=f"s3://{s3_bucket}/p")
    node.write_config(
        f'url = "s3://{s3_bucket}/p"\nkey_file = "{nodes.key_file}"\n'
        f'endpoint_url = "{moto_server.endpoint_url}"\nregion = "{TEST_REGION}"\n'
        'addressing_style = "path"\n'
    )
    node.env = dict(CREDENTIALS)
    node.start()  # with --log-level debug
    assert node.cli("ls").rc == 0
    node.stop()
    log = node.log_path.read_text(errors="replace")
    assert "botocore" in log
    assert_clean(log)
