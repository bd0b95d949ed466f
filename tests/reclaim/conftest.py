"""Fixtures for trigger and migration tests: stores on file:// and on moto S3 (loopback; the
suite's one server, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.storage.keys import generate_signing_key
from gpusnap.storage.store import CheckpointStore
from tests.reclaim.stores import StoreSpec
from tests.support.moto_server import MotoServer


@pytest.fixture(params=["file", "s3"])
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    key_file = tmp_path / "signing.pem"
    generate_signing_key(key_file)
    if request.param == "file":
        return StoreSpec(f"file://{tmp_path / 'store'}", key_file, None)
    moto: MotoServer = request.getfixturevalue("moto_server")
    bucket: str = request.getfixturevalue("s3_bucket")
    return StoreSpec(f"s3://{bucket}/ckpt", key_file, moto.endpoint_url)


@pytest.fixture
def store(store_spec: StoreSpec, tmp_path: Path) -> Iterator[CheckpointStore]:
    with store_spec.open(tmp_path / "cache-main") as s:
        yield s
