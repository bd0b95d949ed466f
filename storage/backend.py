"""The storage backend protocol: a flat key/value object store, about six methods.

Backends know nothing of chunks or manifests; they move opaque bytes under ``/``-separated
keys. Each backend is one module whose factory is registered under its URL scheme (``file``,
``s3``).
Retry, backoff and logging wrap a backend (``RetryingBackend``); they are not inside it.

Errors: a missing key raises ``NotFound``; an ``if_absent`` put onto an existing key raises
``AlreadyExists`` (each backend says both in the same words: ``no_object``, ``key_taken``);
a transport problem raises ``Unavailable`` (retryable); anything else raised by the underlying
library is translated at this boundary. What a valid key is, is ``layout.validate_key``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gpusnap.errors import AlreadyExists, InvalidArgument, NotFound


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch, as the store reports it


# S3's bounds on a multipart part (every part but the last is at least the minimum).
MIN_PART_BYTES = 5 * 1024 * 1024
MAX_PART_BYTES = 5 * 1024 * 1024 * 1024
# The most parallel transfers (and pooled connections) a store is opened with.
MAX_WORKERS = 1024


@dataclass(frozen=True)
class BackendOptions:
    """Everything a URL cannot carry. Unused fields are ignored by backends that need none."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str | None = None  # "path" | "virtual" | "auto"
    profile: str | None = None
    sse: str | None = None  # "AES256" | "aws:kms"
    sse_kms_key_id: str | None = None
    multipart_threshold: int = 64 * 1024 * 1024
    multipart_chunksize: int = 16 * 1024 * 1024
    max_pool_connections: int = 32
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    # How ``open_backend`` wraps the backend in ``RetryingBackend``.
    retry_attempts: int = 6
    retry_base_delay: float = 0.2
    retry_max_delay: float = 10.0
    retry_deadline: float | None = None  # seconds for one call, all attempts together
    # Whether opening a store that does not exist yet creates it (a directory store; S3
    # buckets are never created). Readers pass False: a mistyped path is ``NotFound``.
    create: bool = True


@runtime_checkable
class Backend(Protocol):
    url: str

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Store ``data`` under ``key`` durably before returning.

        With ``if_absent`` the write is a conditional create (S3 ``If-None-Match: *``,
        ``O_EXCL``-style link on a directory) and raises ``AlreadyExists`` if the key exists.
        """
        ...

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """Return ``length`` bytes of ``key`` from ``offset`` (all of the rest when ``None``).

        Fewer bytes come back when the object ends first; an offset at or past the end gives
        ``b""``. A missing key raises ``NotFound``.
        """
        ...

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and mtime of ``key``, or ``None`` when there is no such object."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a plain string prefix, recursive).

        Keys come in ascending order (code point order, which is UTF-8 byte order, as S3
        lists them); ``RetryingBackend`` relies on this to resume a listing that failed.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing key is not an error."""
        ...

    def close(self) -> None: ...


def check_range(key: str, offset: int, length: int | None) -> None:
    """Refuse a ``get`` range no object has (``InvalidArgument``)."""
    if offset < 0 or (length is not None and length < 0):
        raise InvalidArgument(f"invalid range for {key!r}: offset {offset}, length {length}")


def no_object(url: str, key: str) -> NotFound:
    """What every backend raises for a missing key."""
    return NotFound(f"no object {key!r} in {url}")


def key_taken(url: str, key: str) -> AlreadyExists:
    """What every backend raises for an ``if_absent`` put onto an existing key."""
    return AlreadyExists(f"object {key!r} already exists in {url}")


@runtime_checkable
class DeferredSyncBackend(Protocol):
    """Optional: puts that are not durable on return, made durable later in one ``sync``.

    A backend whose durable put is expensive per object (a directory: fsync of the file and
    of its directory) offers this so that a push writes its chunks at disk speed and pays
    for durability once, before its manifest. A backend without it (S3, where a 200 means
    durable) is used through ``put`` and needs no sync; ``put_deferred`` and
    ``sync_deferred`` below pick the right call.
    """

    def put_unsynced(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically (readers never see a partial object),
        but not necessarily durably: a power cut before the next ``sync`` may lose it."""
        ...

    def sync(self, keys: Iterable[str] | None = None) -> None:
        """Make durable the objects under ``keys``, or with ``None`` every object.

        Each key was put with ``put_unsynced``, by this or another process on this host
        (a push may reference chunks another local push wrote); a key that no longer exists
        is skipped. ``None`` covers every ``put_unsynced`` that has returned on this host.
        """
        ...


def put_deferred(backend: Backend, key: str, data: bytes) -> None:
    """``put_unsynced`` where the backend offers it, else a plain (durable) ``put``."""
    if isinstance(backend, DeferredSyncBackend):
        backend.put_unsynced(key, data)
    else:
        backend.put(key, data)


def sync_deferred(backend: Backend, keys: Iterable[str] | None = None) -> None:
    """``sync`` where the backend defers durability (``None``: everything); else nothing."""
    if isinstance(backend, DeferredSyncBackend):
        backend.sync(keys)


@runtime_checkable
class SpaceReserveBackend(Protocol):
    """Optional: space held back on the store's disk for gc to record itself when it is full.

    gc must write its record before deleting anything, and a full disk is when operators
    run it. A backend on a disk that can fill (a directory) keeps a preallocated reserve;
    gc alone releases it, on a full-disk error writing its record, and restores it after
    its sweep. A backend without one (S3) needs none; ``release_space_reserve`` and
    ``restore_space_reserve`` below do nothing there.
    """

    def release_reserve(self) -> bool:
        """Free the reserve; ``True`` if that freed space (there was one)."""
        ...

    def restore_reserve(self) -> bool:
        """Recreate the reserve if it is missing; ``False`` if there is no room for it."""
        ...


def _reserve_holder(backend: Backend) -> SpaceReserveBackend | None:
    # The reserve is a local-disk matter that no retry helps, so wrappers (``RetryingBackend``)
    # do not forward it: look through them to the backend that holds it.
    inner: object = backend
    while not isinstance(inner, SpaceReserveBackend):
        inner = getattr(inner, "inner", None)
        if inner is None:
            return None
    return inner


def release_space_reserve(backend: Backend) -> bool:
    """``release_reserve`` where the backend keeps a reserve; else ``False``."""
    holder = _reserve_holder(backend)
    return holder is not None and holder.release_reserve()


def restore_space_reserve(backend: Backend) -> bool:
    """``restore_reserve`` where the backend keeps a reserve; else ``True`` (none needed)."""
    holder = _reserve_holder(backend)
    return holder is None or holder.restore_reserve()


BackendFactory = Callable[[str, BackendOptions], Backend]

_REGISTRY: dict[str, BackendFactory] = {}


# Built-in backends: their module and factory, imported lazily, only when their scheme is
# asked for, so that ``file://`` users never pay for boto3.
_BUILTIN: dict[str, tuple[str, str]] = {
    "file": ("gpusnap.storage.file_backend", "open_file_backend"),
    "s3": ("gpusnap.storage.s3_backend", "open_s3_backend"),
}


def register_backend(scheme: str, factory: BackendFactory) -> None:
    """Make ``open_backend`` open ``scheme://`` URLs with ``factory`` (a backend of one's own)."""
    _REGISTRY[scheme] = factory


def registered_schemes() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def backend_factory(scheme: str) -> BackendFactory | None:
    if scheme not in _REGISTRY and scheme in _BUILTIN:
        module, name = _BUILTIN[scheme]
        register_backend(scheme, getattr(importlib.import_module(module), name))
    return _REGISTRY.get(scheme)
