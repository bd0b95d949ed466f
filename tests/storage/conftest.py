"""Fixtures for the storage tests: keys, and stores of each kind (a bare backend, or a
checkpoint store on it); S3 is the suite's one moto server (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.storage import CheckpointStore
from gpusnap.storage.backend import open_backend
from tests.storage.store_helpers import Keys, StoreUnderTest, fast_options, file_store, make_keys
from tests.support.moto_server import MotoServer


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
