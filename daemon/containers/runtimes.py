"""The container runtimes of one node: each made once from its options, found by name.

The daemon holds one ``RuntimeSet`` for its life (``[containers.*]`` of its config give the
options, ``detect`` the order in which a container given without a runtime is looked for), and
every job asks it for a runtime instead of making its own, so that a runtime's version is asked
once and two jobs never drive one storage root with different options.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers.containerd import ContainerdRuntime
from gpusnap.daemon.containers.model import ContainerInfo
from gpusnap.daemon.containers.podman import PodmanRuntime
from gpusnap.daemon.containers.runc import RuncRuntime
from gpusnap.daemon.containers.runtime import DEFAULT_CRIU, ContainerRuntime
from gpusnap.errors import InvalidArgument, NotFound, Unsupported

RUNTIMES = ("podman", "runc", "containerd")


def open_runtime(name: str, **options: Any) -> ContainerRuntime:
    """The runtime ``name`` ("podman", "runc", "containerd") with its options (each class's
    keyword arguments: storage roots, socket, binary). Nothing runs until the first call."""
    if name == "podman":
        return PodmanRuntime(**options)
    if name == "runc":
        return RuncRuntime(**options)
    if name == "containerd":
        return ContainerdRuntime(**options)
    raise InvalidArgument(f"unknown container runtime {name!r}; one of {', '.join(RUNTIMES)}")


class RuntimeSet:
    """One node's runtimes: ``options`` per runtime name, ``detect`` the order to look in,
    ``criu`` the CRIU binary they run (asked when a runtime is first made)."""

    def __init__(
        self,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        detect: Sequence[str] = RUNTIMES,
        criu: Callable[[], Path] = lambda: DEFAULT_CRIU,
    ) -> None:
        self._options = {k: dict(v) for k, v in (options or {}).items()}
        self.detect = tuple(detect)
        self._criu = criu
        self._made: dict[str, ContainerRuntime] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> ContainerRuntime:
        """The runtime ``name`` with this node's options for it."""
        with self._lock:
            rt = self._made.get(name)
            if rt is None:
                if name not in RUNTIMES:
                    raise InvalidArgument(
                        f"unknown container runtime {name!r}; one of {', '.join(RUNTIMES)}"
                    )
                rt = open_runtime(name, criu=self._criu(), **self._options.get(name, {}))
                self._made[name] = rt
            return rt

    def find(self, ref: str, runtime: str | None = None) -> tuple[ContainerRuntime, ContainerInfo]:
        """The container ``ref`` and the runtime that has it: ``runtime`` when given (its own
        errors: ``Unsupported`` when it is missing or too old, ``NotFound``), else the first of
        ``detect`` that has it (runtimes missing here are skipped, and named if none has it)."""
        if runtime is not None:
            rt = self.get(runtime)
            return rt, rt.inspect(ref)
        missing: list[str] = []
        for name in self.detect:
            rt = self.get(name)
            try:
                return rt, rt.inspect(ref)
            except NotFound:
                continue
            except Unsupported as err:
                missing.append(str(err))
        extra = f" ({'; '.join(missing)})" if missing else ""
        raise NotFound(f"no container {ref!r} in {', '.join(self.detect)}{extra}")
