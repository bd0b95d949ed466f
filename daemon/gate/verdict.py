"""The compatibility gate's vocabulary: one ``Reason`` per mismatch, and the ``CompatVerdict``.

Made by the host rules (``daemon/gate/compat.py``) and the GPU rules (``daemon/gpu/compat.py``);
shown by ``gpusnap compat`` and recorded by a cold start. Imports nothing, so every package
below the gate may use it too (the GPU layer's rules answer in it; the GPU layer must not reach
the store through it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    """One mismatch between a checkpoint's stamp and this node."""

    field: str  # dotted stamp path, e.g. "gpu.driver_version"
    expected: str  # what the checkpoint recorded
    actual: str  # what this node has
    message: str  # one line an operator understands

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class CompatVerdict:
    checkpoint_id: str
    compatible: bool
    reasons: tuple[Reason, ...] = ()
