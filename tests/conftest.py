"""Suite-wide pytest configuration. Area fixtures live in each area's own conftest.py.

Here: the one moto S3 server of the run (``moto_server``, started when a test first asks
for it, stopped at the end) and a fresh bucket on it per test (``s3_bucket``). Every suite
that needs S3 over HTTP uses these two; none starts a server of its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

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
