"""The container reasons of the compatibility gate: what makes a container checkpoint unusable
on this node, so the workload cold-starts instead (docs/compat.md).

A checkpoint restores only into the runtime it was taken with, at the same major version (the
checkpoint archive's layout and the runtime's metadata are the runtime's own format), and only
where the container's image is already present: the rw-layer diff sits on top of that exact
image, and gpusnap never pulls images from a registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusnap.daemon.containers.model import ContainerInfo
from gpusnap.daemon.containers.runtime import ContainerRuntime, version_tuple
from gpusnap.errors import GpusnapError


@dataclass(frozen=True)
class Mismatch:
    """One reason: the stamp field (``container.…``), what was recorded, what is here, and
    the line an operator reads."""

    field: str
    expected: str
    actual: str
    message: str


def container_mismatches(recorded: ContainerInfo, here: ContainerRuntime) -> list[Mismatch]:
    """Why ``recorded`` (from a checkpoint's record) cannot be restored through ``here``;
    empty when it can. Never raises for a missing runtime: that is a reason too."""
    if recorded.runtime != here.name:
        return [
            Mismatch(
                "container.runtime",
                recorded.runtime,
                here.name,
                f"container runtime differs: checkpoint taken with {recorded.runtime}, "
                f"this node restores with {here.name}",
            )
        ]
    try:
        ver = here.version()
    except GpusnapError as err:
        return [
            Mismatch(
                "container.runtime_version",
                recorded.runtime_version,
                "(unusable)",
                f"container runtime unusable here: {err}",
            )
        ]
    out: list[Mismatch] = []
    was, now = version_tuple(recorded.runtime_version), version_tuple(ver)
    if was[:1] != now[:1]:
        out.append(
            Mismatch(
                "container.runtime_version",
                recorded.runtime_version,
                ver,
                f"{here.name} major version differs: {recorded.runtime_version} at checkpoint, "
                f"{ver} here",
            )
        )
    image = recorded.spec.image_id
    try:
        present = here.image_present(image)
    except GpusnapError as err:
        out.append(
            Mismatch(
                "container.image_digest",
                image,
                "(unknown)",
                f"cannot tell whether image {image} is present: {err}",
            )
        )
    else:
        if not present:
            out.append(
                Mismatch(
                    "container.image_digest",
                    image,
                    "(absent)",
                    f"image {image} ({recorded.spec.image or 'no reference'}) is not present "
                    "on this node",
                )
            )
    return out


def container_reasons(recorded: ContainerInfo, here: ContainerRuntime) -> list[str]:
    """``container_mismatches`` as the lines an operator reads."""
    return [m.message for m in container_mismatches(recorded, here)]
