"""One conformance suite for every backend: the same behaviour from file:// and from S3."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from gpusnap.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from gpusnap.storage.backend import (
    Backend,
    ObjectInfo,
    registered_schemes,
)
from gpusnap.storage.layout import TEMP_PREFIX
from gpusnap.storage.open import open_backend
from tests.storage.store_helpers import MULTIPART_CHUNKSIZE, StoreUnderTest, fast_options
from tests.support.moto_server import MotoServer

BAD_KEYS = ["../x", "/abs", "a/../../x", "a//b", "a/./b", "a\\..\\x", "", "a/", "x\x00y", "."]


def keys(backend: Backend, prefix: str = "") -> list[str]:
    return [info.key for info in backend.list(prefix)]


def test_put_then_get_returns_the_same_bytes(store: StoreUnderTest) -> None:
    data = os.urandom(100_000)
    store.backend.put("chunks/ab/abcdef", data)
    assert store.backend.get("chunks/ab/abcdef") == data


def test_an_empty_object_round_trips(store: StoreUnderTest) -> None:
    store.backend.put("empty", b"")
    assert store.backend.get("empty") == b""
    info = store.backend.stat("empty")
    assert info is not None and info.size == 0


def test_a_plain_put_replaces_the_object(store: StoreUnderTest) -> None:
    store.backend.put("k", b"first")
    store.backend.put("k", b"second, longer")
    assert store.backend.get("k") == b"second, longer"


@pytest.mark.parametrize(
    ("offset", "length", "expected"),
    [
        (0, None, b"0123456789"),
        (3, None, b"3456789"),
        (3, 4, b"3456"),
        (0, 1, b"0"),
        (8, 100, b"89"),  # runs past the end: what is there
        (10, None, b""),  # at the end
        (50, 5, b""),  # past the end
        (4, 0, b""),
    ],
)
def test_ranged_get_returns_the_requested_bytes(
    store: StoreUnderTest, offset: int, length: int | None, expected: bytes
) -> None:
    store.backend.put("r", b"0123456789")
    assert store.backend.get("r", offset=offset, length=length) == expected


def test_a_negative_range_is_refused(store: StoreUnderTest) -> None:
    store.backend.put("r", b"0123456789")
    with pytest.raises(InvalidArgument):
        store.backend.get("r", offset=-1)
    with pytest.raises(InvalidArgument):
        store.backend.get("r", length=-1)


def test_get_of_a_missing_key_raises_not_found(store: StoreUnderTest) -> None:
    with pytest.raises(NotFound) as err:
        store.backend.get("no/such/key")
    assert "no/such/key" in str(err.value)
    with pytest.raises(NotFound):
        store.backend.get("no/such/key", offset=2, length=3)
    with pytest.raises(NotFound):
        store.backend.get("no/such/key", offset=0, length=0)


def test_stat_reports_size_and_mtime_or_none(store: StoreUnderTest) -> None:
    store.backend.put("s/obj", b"x" * 1234)
    info = store.backend.stat("s/obj")
    assert info is not None
    assert info.key == "s/obj"
    assert info.size == 1234
    assert abs(info.mtime - time.time()) < 24 * 3600  # a real epoch time, not 0 or ms
    assert store.backend.stat("s/missing") is None
    assert store.backend.stat("s") is None  # a "directory" is not an object


def test_list_is_recursive_sorted_and_filtered_by_prefix(store: StoreUnderTest) -> None:
    names = ["a/b", "a-c", "a/bc/d", "a/b1", "b/x/y/z", "ab", "manifests/w/1"]
    for i, name in enumerate(names):
        store.backend.put(name, b"#" * i)
    assert keys(store.backend) == sorted(names)
    assert keys(store.backend, "a/") == ["a/b", "a/b1", "a/bc/d"]
    assert keys(store.backend, "a/b") == ["a/b", "a/b1", "a/bc/d"]
    assert keys(store.backend, "a/bc") == ["a/bc/d"]
    assert keys(store.backend, "a") == ["a-c", "a/b", "a/b1", "a/bc/d", "ab"]
    assert keys(store.backend, "b/x/") == ["b/x/y/z"]
    assert keys(store.backend, "nothing/") == []
    sizes = {info.key: info.size for info in store.backend.list("")}
    assert sizes == {name: i for i, name in enumerate(names)}
    assert all(isinstance(info, ObjectInfo) for info in store.backend.list("manifests/"))


def test_list_of_an_empty_store_is_empty(store: StoreUnderTest) -> None:
    assert keys(store.backend) == []


def test_delete_removes_and_is_idempotent(store: StoreUnderTest) -> None:
    store.backend.put("d/one", b"1")
    store.backend.put("d/two", b"2")
    store.backend.delete("d/one")
    assert store.backend.stat("d/one") is None
    with pytest.raises(NotFound):
        store.backend.get("d/one")
    store.backend.delete("d/one")  # again: no error
    store.backend.delete("d/never-was")
    assert keys(store.backend, "d/") == ["d/two"]


def test_if_absent_creates_a_missing_key(store: StoreUnderTest) -> None:
    store.backend.put("manifests/w/cp1", b"manifest", if_absent=True)
    assert store.backend.get("manifests/w/cp1") == b"manifest"


def test_if_absent_on_an_existing_key_raises_and_keeps_the_object(
    store: StoreUnderTest,
) -> None:
    store.backend.put("manifests/w/cp1", b"original")
    with pytest.raises(AlreadyExists) as err:
        store.backend.put("manifests/w/cp1", b"usurper", if_absent=True)
    assert "manifests/w/cp1" in str(err.value)
    assert store.backend.get("manifests/w/cp1") == b"original"


def test_racing_if_absent_puts_have_exactly_one_winner(store: StoreUnderTest) -> None:
    racers = 8
    barrier = threading.Barrier(racers)
    outcomes: dict[int, str] = {}

    def race(i: int) -> None:
        barrier.wait()
        try:
            store.backend.put("claims/lease", f"owner-{i}".encode(), if_absent=True)
            outcomes[i] = "won"
        except AlreadyExists:
            outcomes[i] = "lost"
        except Exception as exc:  # reported below, so a failure names the cause
            outcomes[i] = repr(exc)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, outcome in outcomes.items() if outcome == "won"]
    assert sorted(outcomes.values()) == ["lost"] * (racers - 1) + ["won"], outcomes
    assert store.backend.get("claims/lease") == f"owner-{winners[0]}".encode()


def test_a_large_object_round_trips_through_multipart(store: StoreUnderTest) -> None:
    data = os.urandom(12 * 1024 * 1024 + 123)
    store.backend.put("packs/big", data)
    assert store.backend.get("packs/big") == data
    # A range across the first part boundary.
    edge = MULTIPART_CHUNKSIZE
    assert (
        store.backend.get("packs/big", offset=edge - 10, length=20) == data[edge - 10 : edge + 10]
    )
    info = store.backend.stat("packs/big")
    assert info is not None and info.size == len(data)
    if store.kind == "s3":
        assert store.moto is not None and store.bucket is not None
        client = store.moto.client()
        head = client.head_object(Bucket=store.bucket, Key=f"{store.prefix}packs/big")
        client.close()
        # S3 (and moto) give a multipart object the ETag "<md5 of part md5s>-<part count>".
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]


def test_a_large_if_absent_put_conflicts_and_leaves_no_upload_behind(
    store: StoreUnderTest,
) -> None:
    big = os.urandom(6 * 1024 * 1024)
    store.backend.put("packs/p", big, if_absent=True)
    with pytest.raises(AlreadyExists):
        store.backend.put("packs/p", os.urandom(6 * 1024 * 1024), if_absent=True)
    assert store.backend.get("packs/p") == big
    if store.kind == "s3":
        assert store.moto is not None
        client = store.moto.client()
        uploads = client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
        client.close()
        assert uploads == []  # the losing upload was aborted, not left to be billed
    else:
        assert store.root is not None
        assert sorted(os.listdir(store.root / "packs")) == ["p"]  # no temp file left


@pytest.mark.parametrize(("sse", "kms_key"), [("AES256", None), ("aws:kms", "alias/gpusnap-test")])
@pytest.mark.parametrize("size", [100, 6 * 1024 * 1024])  # single put and multipart
def test_s3_server_side_encryption_is_requested_on_every_write(
    moto_server: MotoServer, s3_bucket: str, sse: str, kms_key: str | None, size: int
) -> None:
    options = fast_options(moto_server.endpoint_url, sse=sse, sse_kms_key_id=kms_key)
    backend = open_backend(f"s3://{s3_bucket}", options)
    data = os.urandom(size)
    backend.put("enc", data)
    assert backend.get("enc") == data
    backend.close()
    client = moto_server.client()
    head = client.head_object(Bucket=s3_bucket, Key="enc")
    client.close()
    assert head["ServerSideEncryption"] == sse
    if kms_key:
        assert kms_key in head["SSEKMSKeyId"]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_unsafe_keys_are_refused_by_every_operation(store: StoreUnderTest, bad: str) -> None:
    with pytest.raises(InvalidArgument):
        store.backend.put(bad, b"x")
    with pytest.raises(InvalidArgument):
        store.backend.put(bad, b"x", if_absent=True)
    with pytest.raises(InvalidArgument):
        store.backend.get(bad)
    with pytest.raises(InvalidArgument):
        store.backend.stat(bad)
    with pytest.raises(InvalidArgument):
        store.backend.delete(bad)
    assert keys(store.backend) == []
    if store.root is not None:
        assert not (store.root.parent / "x").exists()
        assert not os.path.exists("/abs")


@pytest.mark.parametrize("bad", ["../", "/abs", "a//", "..", "a\\b"])
def test_unsafe_list_prefixes_are_refused(store: StoreUnderTest, bad: str) -> None:
    with pytest.raises(InvalidArgument):
        list(store.backend.list(bad))


# -- open_backend -------------------------------------------------------------------------


def test_both_builtin_schemes_are_registered() -> None:
    assert {"file", "s3"} <= set(registered_schemes())


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("", "empty"),
        ("/just/a/path", "no scheme"),
        ("ftp://host/x", "unknown scheme"),
        ("file://relative/path", "host"),
        ("file:relative", "no scheme"),
        ("file:///a?b=c", "query"),
        ("s3://", "no bucket"),
        ("s3://Not_A_Bucket/x", "bucket"),
        ("s3://bucket/../x", "invalid"),
        ("s3://user:pw@bucket/x", "credentials"),
    ],
)
def test_a_bad_store_url_is_refused_with_one_clear_line(url: str, words: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        open_backend(url)
    message = str(err.value)
    assert words in message
    assert "\n" not in message


# -- file:// specifics --------------------------------------------------------------------


def test_file_store_keeps_its_contents_private_and_hides_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    backend = open_backend(f"file://{root}", fast_options())
    backend.put("chunks/aa/bb", b"secret process memory")
    assert (root.stat().st_mode & 0o777) == 0o700
    assert ((root / "chunks").stat().st_mode & 0o777) == 0o700
    assert ((root / "chunks" / "aa" / "bb").stat().st_mode & 0o777) == 0o600
    # A temp file left by a writer that crashed is neither listed nor addressable.
    (root / "chunks" / "aa" / f"{TEMP_PREFIX}deadbeef").write_bytes(b"partial")
    assert keys(backend) == ["chunks/aa/bb"]
    with pytest.raises(InvalidArgument):
        backend.get(f"chunks/aa/{TEMP_PREFIX}deadbeef")


def test_file_store_url_may_be_percent_encoded(tmp_path: Path) -> None:
    root = tmp_path / "with space"
    backend = open_backend(f"file://{str(root).replace(' ', '%20')}", fast_options())
    backend.put("k", b"v")
    assert (root / "k").read_bytes() == b"v"


def test_file_store_refuses_a_key_below_an_existing_object(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}", fast_options())
    backend.put("a", b"object")
    with pytest.raises(FailedPrecondition):
        backend.put("a/b", b"x")
    assert backend.get("a") == b"object"
