"""``with server:`` for the loopback servers the tests start (moto, proxies, metadata)."""

from __future__ import annotations

from typing import Self


class StartStop:
    """A mixin: ``with x:`` is ``x.start()``, the block, then ``x.stop()`` whatever it raised."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
