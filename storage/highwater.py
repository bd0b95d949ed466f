"""The node's high-water marks: per store and workload, the newest head record it has seen.

A head record (``heads.py``) older than the mark, or missing while a mark exists, means the
store was rolled back or frozen. The marks are local state, one JSON file (the daemon's
``<state_dir>/heads.json``; a store opened without one names ``<cache dir>/heads.json``)::

    {"version": 1, "stores": {"<store id>": {"<workload>": {"sequence": 7,
                                                          "checkpoint_id": "..."}}}}

Several processes may update it at once (the daemon, ``gpusnap store`` commands): every
change is a read-modify-write under an exclusive ``flock`` of ``heads.json.lock``, written
to a temp file, fsynced and renamed into place. A mark only ever rises, except where an
operator accepts a rollback (``reset``).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.errors import FailedPrecondition

_Stores = dict[str, dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class Mark:
    sequence: int
    checkpoint_id: str


class HighWaterMarks:
    """The marks kept in ``path``; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, store: str, workload: str) -> Mark | None:
        with self._locked():
            return _mark(self._read(), store, workload)

    def raise_to(self, store: str, workload: str, mark: Mark) -> None:
        """Record ``mark`` unless the node has already seen a higher sequence."""

        def change(stores: _Stores) -> None:
            have = _mark(stores, store, workload)
            if have is None or have.sequence < mark.sequence:
                stores.setdefault(store, {})[workload] = _entry(mark)

        self._update(change)

    def reset(self, store: str, workload: str, mark: Mark | None) -> None:
        """Set the mark to ``mark`` (``None``: forget it) even if lower: a rollback accepted."""

        def change(stores: _Stores) -> None:
            marks = stores.setdefault(store, {})
            if mark is None:
                marks.pop(workload, None)
            else:
                marks[workload] = _entry(mark)

        self._update(change)

    def _update(self, change: Callable[[_Stores], None]) -> None:
        with self._locked():
            stores = self._read()
            change(stores)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            data = json.dumps({"version": 1, "stores": stores}, sort_keys=True).encode()
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
            except OSError as exc:
                raise FailedPrecondition(
                    f"cannot write the high-water marks {self.path}: {exc.strerror}"
                ) from exc

    @contextmanager
    def _locked(self) -> Iterator[None]:
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot open the high-water marks {self.path}: {exc.strerror}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self) -> _Stores:
        try:
            body = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            raise FailedPrecondition(
                f"the high-water marks {self.path} are unreadable ({exc}); move the file "
                "aside to start over (this node then forgets which heads it has seen)"
            ) from exc
        stores = body.get("stores") if isinstance(body, dict) else None
        if not isinstance(stores, dict) or not all(isinstance(v, dict) for v in stores.values()):
            raise FailedPrecondition(f"the high-water marks {self.path} are not a marks file")
        return stores


def _entry(mark: Mark) -> dict[str, Any]:
    return {"sequence": mark.sequence, "checkpoint_id": mark.checkpoint_id}


def _mark(stores: _Stores, store: str, workload: str) -> Mark | None:
    entry = stores.get(store, {}).get(workload)
    if not isinstance(entry, dict):
        return None
    sequence, checkpoint_id = entry.get("sequence"), entry.get("checkpoint_id")
    if (
        not isinstance(sequence, int)
        or isinstance(sequence, bool)
        or not isinstance(checkpoint_id, str)
    ):
        return None
    return Mark(sequence, checkpoint_id)
