"""Fixtures for trigger and migration tests: stores on file:// and on moto S3 (loopback; the
suite's one server, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpusnap.storage.backend import BackendOptions
from gpusnap.storage.keys import generate_signing_key
from gpusnap.storage.store import CheckpointStore, open_store
from tests.support.moto_server import TEST_REGION, MotoServer


@dataclass(frozen=True)
class StoreSpec:
    """Enough to open the same store again, in this process or another."""

    url: str
    key_file: Path
    endpoint_url: str | None

    def options(self) -> BackendOptions:
        return BackendOptions(
            endpoint_url=self.endpoint_url,
            region=TEST_REGION,
            addressing_style="path",
            retry_attempts=3,
            retry_base_delay=0.01,
            retry_max_delay=0.1,
        )

    def open(self, cache_dir: Path) -> CheckpointStore:
        return open_store(
            self.url, key_file=self.key_file, options=self.options(), cache_dir=cache_dir
        )


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
