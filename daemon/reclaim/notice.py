"""The ``Notice``: one signal that the node is going away, as every part of reclaim sees it.

Watchers (``aws``, ``gcp``, ``azure``, ``shutdown``) make notices; the ``TriggerManager``
delivers each one once; the ``PolicyEngine`` turns it into checkpoint jobs. A notice is a plain
value with two callbacks its source attaches (``ack``, ``on_done``); this module imports nothing
of gpusnap.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

NoticeKind = Literal["reclaim", "rebalance", "maintenance", "shutdown"]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Notice:
    """One signal that the node is going away (or may soon).

    ``deadline`` is the epoch second by which a checkpoint must be committed (``None`` for an
    advisory signal). ``ack`` tells the source the node is done with it — Azure approves the
    event, which lets the platform proceed early — and is called only after every checkpoint
    the notice started has committed. ``on_done`` is called once handling ends, committed or
    not (logind: release the shutdown delay lock).
    """

    provider: str  # aws | gcp | azure | node | drill
    kind: NoticeKind
    deadline: float | None
    event_id: str
    detail: str = ""
    received_at: float = 0.0
    ack: Callable[[], None] = field(default=_nothing, compare=False, repr=False)
    on_done: Callable[[], None] = field(default=_nothing, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.provider, self.kind, self.event_id)

    @property
    def trigger(self) -> str:
        """The job trigger label, e.g. ``reclaim:aws``."""
        return f"{self.kind}:{self.provider}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "kind": self.kind,
            "deadline": self.deadline,
            "event_id": self.event_id,
            "detail": self.detail,
            "received_at": self.received_at,
        }


def drill_notice(deadline_s: float, *, clock: Callable[[], float] = time.time) -> Notice:
    """A reclaim notice as if the cloud had sent one, for ``gpusnap drill reclaim``."""
    now = clock()
    return Notice(
        provider="drill",
        kind="reclaim",
        deadline=now + deadline_s,
        event_id=f"drill-{uuid.uuid4().hex[:12]}",
        detail=f"operator drill, deadline {deadline_s:g} s",
        received_at=now,
    )
