"""Faults: a flaky or absent S3 server, a full disk; and what the retry wrapper does about them."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from gpusnap.storage.backend import Backend, ObjectInfo, backend_factory
from gpusnap.storage.file_backend import FileBackend
from gpusnap.storage.layout import TEMP_PREFIX
from gpusnap.storage.open import open_backend
from gpusnap.storage.passthrough import PassThroughBackend
from gpusnap.storage.retry import RetryingBackend
from tests.storage.store_helpers import fast_options, mounted_tmpfs
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import MotoServer

ATTEMPTS = 4  # fast_options(): 4 attempts, 10-50 ms apart


@pytest.fixture
def s3(proxy: FaultProxy, s3_bucket: str) -> Iterator[Backend]:
    """An S3 store reached through the fault proxy, wrapped by ``open_backend``'s retries."""
    backend = open_backend(
        f"s3://{s3_bucket}/ckpt", fast_options(proxy.endpoint_url, connect_timeout=2.0)
    )
    yield backend
    backend.close()


def direct_get(moto: MotoServer, bucket: str, key: str) -> bytes:
    """Read an object behind the proxy's back: what the server really holds."""
    client = moto.client()
    try:
        body: bytes = client.get_object(Bucket=bucket, Key=f"ckpt/{key}")["Body"].read()
        return body
    finally:
        client.close()


# -- 5xx and dropped connections are retried ----------------------------------------------


def test_503s_for_a_while_are_retried_and_the_put_succeeds(
    s3: Backend,
    proxy: FaultProxy,
    moto_server: MotoServer,
    s3_bucket: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy.fail_next(ATTEMPTS - 1, status=503)
    with caplog.at_level(logging.WARNING, logger="gpusnap.storage.retry"):
        s3.put("chunks/ab/c1", b"payload")
    assert proxy.outcomes() == ["failed"] * (ATTEMPTS - 1) + ["forwarded"]
    assert direct_get(moto_server, s3_bucket, "chunks/ab/c1") == b"payload"
    retries = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(retries) == ATTEMPTS - 1
    assert all("chunks/ab/c1" in r.getMessage() for r in retries)
    assert "SlowDown" in retries[0].getMessage()


def test_500s_on_a_get_are_retried(s3: Backend, proxy: FaultProxy) -> None:
    s3.put("k", b"0123456789")
    proxy.fail_next(2, status=500)
    assert s3.get("k", offset=2, length=3) == b"234"
    assert proxy.outcomes()[-3:] == ["failed", "failed", "forwarded"]


def test_a_dropped_connection_is_retried(s3: Backend, proxy: FaultProxy) -> None:
    proxy.drop_next(1)
    s3.put("k", b"value")
    assert proxy.outcomes() == ["dropped", "forwarded"]
    assert s3.get("k") == b"value"


def test_a_multipart_put_failing_mid_upload_is_redone_and_leaves_no_upload(
    s3: Backend, proxy: FaultProxy, moto_server: MotoServer, s3_bucket: str
) -> None:
    data = os.urandom(11 * 1024 * 1024)
    proxy.fail_next(1, status=503, match="partNumber=2")
    s3.put("packs/big", data)
    sent = [(method, path) for method, path, _ in proxy.requests]
    creates = [p for m, p in sent if m == "POST" and p.endswith("?uploads")]
    aborts = [p for m, p in sent if m == "DELETE" and "uploadId=" in p]
    assert len(creates) == 2 and len(aborts) == 1  # the failed upload was aborted, then redone
    assert direct_get(moto_server, s3_bucket, "packs/big") == data
    client = moto_server.client()
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    client.close()


def test_persistent_503s_give_up_with_one_line_after_the_configured_attempts(
    s3: Backend, proxy: FaultProxy
) -> None:
    proxy.fail_next(1000, status=503)
    with pytest.raises(Unavailable) as err:
        s3.put("k", b"v")
    message = str(err.value)
    assert "\n" not in message
    assert f"gave up after {ATTEMPTS} attempts" in message
    assert "SlowDown" in message and "'k'" in message
    assert proxy.outcomes() == ["failed"] * ATTEMPTS


def test_a_stopped_server_gives_a_one_line_unavailable_after_bounded_retries(
    s3: Backend, proxy: FaultProxy
) -> None:
    proxy.go_down()
    with pytest.raises(Unavailable) as err:
        s3.put("k", b"v")
    message = str(err.value)
    assert "\n" not in message
    assert "cannot reach S3" in message
    assert f"gave up after {ATTEMPTS} attempts" in message
    with pytest.raises(Unavailable):
        s3.get("k")
    assert proxy.requests == []  # refused at connect: nothing reached the proxy
    proxy.go_up()
    s3.put("k", b"v")  # the same backend works again once the server is back
    assert s3.get("k") == b"v"


def test_the_retry_deadline_bounds_the_total_wait(proxy: FaultProxy, s3_bucket: str) -> None:
    factory = backend_factory("s3")
    assert factory is not None
    raw = factory(f"s3://{s3_bucket}/ckpt", fast_options(proxy.endpoint_url))
    now = [0.0]
    slept: list[float] = []

    def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    backend = RetryingBackend(
        raw,
        attempts=1000,
        base_delay=1.0,
        max_delay=4.0,
        deadline=10.0,
        sleep=fake_sleep,
        clock=lambda: now[0],
    )
    proxy.fail_next(1_000_000, status=503)
    with pytest.raises(Unavailable) as err:
        backend.put("k", b"v")
    assert "deadline reached" in str(err.value)
    assert sum(slept) < 10.0
    assert len(proxy.requests) == len(slept) + 1 < 1000
    backend.close()


# -- what is never retried ----------------------------------------------------------------


def test_not_found_is_final_on_the_first_attempt(s3: Backend, proxy: FaultProxy) -> None:
    with pytest.raises(NotFound):
        s3.get("missing")
    assert proxy.outcomes() == ["forwarded"]


def test_already_exists_is_final_on_the_first_attempt(s3: Backend, proxy: FaultProxy) -> None:
    s3.put("manifest", b"mine")
    with pytest.raises(AlreadyExists):
        s3.put("manifest", b"theirs", if_absent=True)
    assert proxy.outcomes() == ["forwarded", "forwarded"]


def test_access_denied_is_final_and_names_the_bucket(
    s3: Backend, proxy: FaultProxy, s3_bucket: str
) -> None:
    proxy.fail_next(1, status=403)
    with pytest.raises(FailedPrecondition) as err:
        s3.put("k", b"v")
    assert "access denied" in str(err.value) and s3_bucket in str(err.value)
    assert proxy.outcomes() == ["failed"]


def test_a_missing_bucket_is_not_found_and_named(moto_server: MotoServer) -> None:
    backend = open_backend("s3://no-such-bucket-here/p", fast_options(moto_server.endpoint_url))
    with pytest.raises(NotFound) as err:
        backend.put("k", b"v")
    assert "bucket 'no-such-bucket-here' does not exist" in str(err.value)
    backend.close()


# -- ambiguous failures of conditional puts -----------------------------------------------


def test_an_if_absent_put_whose_reply_was_lost_succeeds_on_retry(
    s3: Backend, proxy: FaultProxy, moto_server: MotoServer, s3_bucket: str
) -> None:
    proxy.lose_reply_next(1)
    s3.put("manifests/w/cp1", b"the manifest", if_absent=True)  # no AlreadyExists
    outcomes = proxy.outcomes()
    assert outcomes[0] == "reply-lost"  # the store applied it; the client never heard
    assert "forwarded" in outcomes[1:]  # the retry, which found the object, then read it
    assert direct_get(moto_server, s3_bucket, "manifests/w/cp1") == b"the manifest"


def test_a_lost_reply_does_not_hide_a_real_conflict(s3: Backend, proxy: FaultProxy) -> None:
    s3.put("claims/lease", b"owner-A")
    proxy.lose_reply_next(1)
    with pytest.raises(AlreadyExists):
        s3.put("claims/lease", b"owner-B", if_absent=True)
    assert s3.get("claims/lease") == b"owner-A"


def test_a_conditional_request_conflict_is_retried_to_a_definite_answer(
    s3: Backend, proxy: FaultProxy
) -> None:
    proxy.fail_next(1, status=409)  # S3: another conditional write to this key is in flight
    s3.put("claims/a", b"owner-A", if_absent=True)
    assert s3.get("claims/a") == b"owner-A"
    proxy.fail_next(1, status=409)
    with pytest.raises(AlreadyExists):
        s3.put("claims/a", b"owner-B", if_absent=True)
    assert s3.get("claims/a") == b"owner-A"


# -- listing resumes ----------------------------------------------------------------------


class FailsOnceMidList(PassThroughBackend):
    """A real file store whose first listing breaks after ``after`` objects."""

    def __init__(self, inner: FileBackend, after: int) -> None:
        super().__init__(inner)
        self.after = after
        self.listings = 0

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.listings += 1
        for n, info in enumerate(self.inner.list(prefix)):
            if self.listings == 1 and n == self.after:
                raise Unavailable("listing connection reset")
            yield info


def test_a_listing_that_fails_part_way_resumes_without_repeats(tmp_path: Path) -> None:
    flaky = FailsOnceMidList(FileBackend(str(tmp_path)), after=3)
    names = [f"chunks/{i:02d}" for i in range(7)]
    for name in names:
        flaky.put(name, b"x")
    backend = RetryingBackend(flaky, attempts=3, base_delay=0.0, max_delay=0.0)
    assert [info.key for info in backend.list("chunks/")] == names
    assert flaky.listings == 2


# -- a full disk --------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, so that ENOSPC is real."""
    with mounted_tmpfs(tmp_path / "tiny", "1m") as mount_point:
        yield mount_point


@pytest.mark.parametrize("if_absent", [False, True])
def test_a_full_disk_is_a_clear_error_and_leaves_no_partial_file(
    tiny_disk: Path, if_absent: bool
) -> None:
    backend = open_backend(f"file://{tiny_disk}/store", fast_options())
    backend.put("chunks/small", b"s" * 1000)
    with pytest.raises(FailedPrecondition) as err:
        backend.put("chunks/big", os.urandom(2 * 1024 * 1024), if_absent=if_absent)
    message = str(err.value)
    assert message.startswith("store disk full:")
    assert "chunks/big" in message and "\n" not in message
    assert "gave up" not in message  # not retried: waiting does not free a disk
    leftovers = os.listdir(tiny_disk / "store" / "chunks")
    assert leftovers == ["small"]
    assert not any(name.startswith(TEMP_PREFIX) for name in leftovers)
    assert backend.stat("chunks/big") is None
    backend.put("chunks/after", b"fits")  # the space the failed put took was given back
    assert backend.get("chunks/after") == b"fits"
