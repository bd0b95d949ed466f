"""The storage backend protocol: a flat key/value object store, about six methods.

Backends know nothing of chunks or manifests; they move opaque bytes under ``/``-separated
keys. Each backend is one module registered under its URL scheme (``file``, ``s3``).
Retry, backoff and logging wrap a backend (``RetryingBackend``); they are not inside it.

Errors: a missing key raises ``NotFound``; an ``if_absent`` put onto an existing key raises
``AlreadyExists``; a transport problem raises ``Unavailable`` (retryable); anything else
raised by the underlying library is translated at this boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch, as the store reports it


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


@runtime_checkable
class Backend(Protocol):
    url: str

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Store ``data`` under ``key`` durably before returning.

        With ``if_absent`` the write is a conditional create (S3 ``If-None-Match: *``,
        ``O_EXCL``-style link on a directory) and raises ``AlreadyExists`` if the key exists.
        """
        ...

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes: ...

    def stat(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing key is not an error."""
        ...

    def close(self) -> None: ...


BackendFactory = Callable[[str, BackendOptions], Backend]

_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(scheme: str, factory: BackendFactory) -> None:
    _REGISTRY[scheme] = factory


def registered_schemes() -> list[str]:
    return sorted(_REGISTRY)


def backend_factory(scheme: str) -> BackendFactory | None:
    return _REGISTRY.get(scheme)
