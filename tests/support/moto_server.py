"""A real moto S3 server in a subprocess on 127.0.0.1, for tests that need S3 over HTTP.

    with MotoServer() as moto:
        moto.create_bucket("ckpt")
        backend = open_backend("s3://ckpt/p", BackendOptions(endpoint_url=moto.endpoint_url))

Tests do not start one: they take the suite's one server, the session fixture
``moto_server``, and a fresh bucket on it, ``s3_bucket`` (both in tests/conftest.py). The
benchmarks under bench/, which run without pytest, start their own.

The server binds port 0 itself and reports the port it got, so two suites never race for a
port. ``stop()`` terminates the process and waits for it (no zombie, no stray server).

Serialized requests (the default): moto checks ``If-None-Match: *`` and stores the object in
two separate steps with no lock, so two racing conditional puts can both succeed on moto,
while real S3 decides atomically (one 200, one 412 or 409). The launcher below wraps moto's
WSGI app in one lock, which gives moto S3's atomicity; pass ``serialize=False`` for plain moto.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO, Any

import boto3
from botocore.config import Config

from tests.support.lifecycle import StartStop

TEST_REGION = "us-east-1"

# Runs in the child: moto's own app, optionally behind one lock, on a port the kernel picks.
_LAUNCHER = r"""
import logging, os, signal, sys, threading
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app,
)

serialize = sys.argv[1] == "1"
logging.getLogger("werkzeug").setLevel(logging.ERROR)
app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()

def serialized(environ, start_response):
    with lock:
        result = app(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
    return [body]

server = make_server(
    "127.0.0.1", 0, serialized if serialize else app, threaded=True,
    request_handler=MotoRequestHandler,
)
os.environ["MOTO_PORT"] = str(server.server_port)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
sys.stdout.write(f"{server.server_port}\n")
sys.stdout.flush()
server.serve_forever()
"""


class MotoServerError(RuntimeError):
    """The moto server could not be started."""


class MotoServer(StartStop):
    """A moto S3 server subprocess; a context manager, or ``start()``/``stop()`` by hand."""

    def __init__(self, *, serialize: bool = True, startup_timeout: float = 60.0) -> None:
        self.serialize = serialize
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise MotoServerError("moto server is not running")
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start the server and return its endpoint URL once it answers HTTP."""
        if self._proc is not None:
            return self.endpoint_url
        self._log = tempfile.TemporaryFile(prefix="moto-server-")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, "1" if self.serialize else "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        try:
            assert self._proc.stdout is not None
            line = self._proc.stdout.readline()  # the port, or EOF if it died
            if not line.strip().isdigit():
                raise MotoServerError(f"moto server did not start: {self._log_tail()}")
            self._port = int(line)
            self._wait_until_answering()
        except BaseException:
            self.stop()
            raise
        return self.endpoint_url

    def stop(self) -> None:
        """Terminate the server and reap it. Safe to call twice."""
        proc, self._proc = self._proc, None
        self._port = None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def client(self, region: str = TEST_REGION) -> Any:
        """A plain boto3 S3 client for this server (test setup and inspection)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=region,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(retries={"total_max_attempts": 1, "mode": "standard"}),
        )

    def create_bucket(self, name: str) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        finally:
            client.close()

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/data.json", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError) as exc:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise MotoServerError(
                        f"moto server exited with {self._proc.returncode}: {self._log_tail()}"
                    ) from exc
                if time.monotonic() > deadline:
                    raise MotoServerError(
                        f"moto server did not answer within {self.startup_timeout}s"
                    ) from exc
                time.sleep(0.05)

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return " ".join(self._log.read()[-2000:].decode(errors="replace").split())


@contextlib.contextmanager
def aws_test_credentials(region: str = TEST_REGION) -> Iterator[None]:
    """Dummy credentials and a region in the environment, restored afterwards.

    Also keeps boto3 away from a developer's real profile and from instance metadata.
    """
    values = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": region,
        "AWS_REGION": region,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    removed = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
    saved = {name: os.environ.get(name) for name in (*values, *removed)}
    os.environ.update(values)
    for name in removed:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
