"""Fixtures for the storage tests: keys, and stores of each kind (a bare backend, or a
checkpoint store on it); S3 is the suite's one moto server (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpusnap.storage import CheckpointStore
from gpusnap.storage.backend import Backend, BackendOptions
from gpusnap.storage.open import open_backend
from tests.storage.store_helpers import Keys, file_store, make_keys
from tests.support.moto_server import TEST_REGION, MotoServer

# Small enough that a 12 MiB object goes up in three real parts (S3's floor is 5 MiB).
MULTIPART_THRESHOLD = 5 * 1024 * 1024 + 1
MULTIPART_CHUNKSIZE = 5 * 1024 * 1024


def fast_options(endpoint_url: str | None = None, **overrides: Any) -> BackendOptions:
    """Options with small multipart sizes and fast retries, for every storage test."""
    values: dict[str, Any] = {
        "endpoint_url": endpoint_url,
        "region": TEST_REGION,
        "addressing_style": "path",
        "multipart_threshold": MULTIPART_THRESHOLD,
        "multipart_chunksize": MULTIPART_CHUNKSIZE,
        "retry_attempts": 4,
        "retry_base_delay": 0.01,
        "retry_max_delay": 0.05,
    }
    values.update(overrides)
    return BackendOptions(**values)


@dataclass
class StoreUnderTest:
    kind: str  # "file" | "s3"
    backend: Backend
    root: Path | None = None  # file: the directory
    bucket: str | None = None  # s3: the bucket; objects live under ``prefix``
    prefix: str = ""
    moto: MotoServer | None = None


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
