"""A backend that forwards every call to the one it wraps: the base of wrappers that add a step.

A wrapper (the cache-seeding one, a test's recorder or fault injector) overrides the calls it
adds something to and inherits the rest. It keeps the wrapped backend as ``inner``, the name
``backend._reserve_holder`` looks through to find a space reserve.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpusnap.storage.backend import Backend, ObjectInfo


class PassThroughBackend:
    """``inner``, unchanged: every ``Backend`` call is ``inner``'s."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.get(key, offset=offset, length=length)

    def stat(self, key: str) -> ObjectInfo | None:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()
