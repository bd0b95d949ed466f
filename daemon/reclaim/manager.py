"""The watcher protocol, and the manager that runs watchers and delivers their notices once.

A watcher knows one signal source (an instance metadata key, logind); one ``poll`` asks it
once and returns what is pending *now*. The ``TriggerManager`` owns the threads: it polls each
watcher at its pace, backs off while a source is down, slow or answering garbage, reports
every poll in ``state()``, and hands each notice it has not seen before to ``on_notice``.
Deduplication is by ``Notice.key`` (provider, kind, event id), so a notice that a service
keeps repeating reaches the handler once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpusnap.daemon.reclaim.notice import Notice
from gpusnap.errors import GpusnapError

log = logging.getLogger(__name__)


class Watcher(Protocol):
    """One signal source, polled by the manager's thread for it."""

    name: str  # unique among a manager's watchers, e.g. "aws", "gcp:preempted"
    provider: str
    poll_interval: float  # seconds from the start of one poll to the start of the next

    def poll(self) -> list[Notice]:
        """Ask the source once; return the notices pending now (possibly repeats).

        Raise a ``GpusnapError`` (``Unavailable``, ``Corrupt``…) when the source cannot be
        read; the call itself is bounded by the watcher's own timeouts.
        """
        ...

    def close(self) -> None: ...


@dataclass
class WatcherState:
    name: str
    provider: str
    polls: int = 0
    failures: int = 0  # consecutive
    errors: int = 0  # in all
    last_poll_at: float | None = None
    last_ok_at: float | None = None
    last_error: str | None = None
    last_error_kind: str | None = None
    last_notice: Notice | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "provider": self.provider,
            "polls": self.polls,
            "consecutive_failures": self.failures,
            "errors": self.errors,
            "last_poll_at": self.last_poll_at,
            "last_ok_at": self.last_ok_at,
            "last_poll_ok": self.polls > 0 and self.failures == 0,
            "last_error": self.last_error,
            "last_error_kind": self.last_error_kind,
            "last_notice": self.last_notice.to_dict() if self.last_notice else None,
        }


NoticeHandler = Callable[[Notice], None]


class TriggerManager:
    """Runs watchers in daemon threads and delivers each new notice once.

    ``on_notice`` runs on the watcher's thread and must return quickly (the policy engine
    starts its work on threads of its own). A handler that raises is logged, never fatal.
    """

    def __init__(
        self,
        watchers: list[Watcher],
        on_notice: NoticeHandler,
        *,
        max_backoff: float = 60.0,
        clock: Callable[[], float] = time.time,
        detail: str = "",
    ) -> None:
        names = [w.name for w in watchers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate watcher names: {names}")
        self._watchers = list(watchers)
        self._on_notice = on_notice
        self._max_backoff = max_backoff
        self._clock = clock
        self.detail = detail  # e.g. how "auto" decided; shown by `gpusnap triggers`
        self._lock = threading.Lock()
        self._seen: set[tuple[str, str, str]] = set()
        self._states = {w.name: WatcherState(w.name, w.provider) for w in watchers}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def watchers(self) -> list[Watcher]:
        return list(self._watchers)

    def start(self) -> None:
        for w in self._watchers:
            t = threading.Thread(target=self._run, args=(w,), name=f"trigger-{w.name}")
            t.daemon = True
            t.start()
            self._threads.append(t)
        log.info(
            "trigger watchers started: %s", ", ".join(w.name for w in self._watchers) or "none"
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling. A poll in flight finishes within its own timeout."""
        self._stop.set()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        for w in self._watchers:
            try:
                w.close()
            except Exception:
                log.exception("closing watcher %s", w.name)

    def submit(self, notice: Notice) -> bool:
        """Deliver a notice from outside a watcher (SIGTERM, a drill); False if seen before."""
        return self._deliver(notice, state=None)

    def state(self) -> list[WatcherState]:
        with self._lock:
            return [replace(s) for s in self._states.values()]

    def state_dict(self) -> dict[str, Any]:
        """What ``gpusnap triggers`` shows."""
        return {"detail": self.detail, "watchers": [s.to_dict() for s in self.state()]}

    def poll_once(self, watcher: Watcher) -> bool:
        """One poll of ``watcher`` with state bookkeeping; True if it succeeded."""
        state = self._states[watcher.name]
        started = self._clock()
        try:
            notices = watcher.poll()
        except GpusnapError as exc:
            self._record_failure(state, started, exc.kind, str(exc))
            return False
        except Exception as exc:  # a bug in a watcher must not end its thread
            log.exception("watcher %s failed unexpectedly", watcher.name)
            self._record_failure(state, started, "internal", f"{type(exc).__name__}: {exc}")
            return False
        with self._lock:
            if state.failures:
                log.info("watcher %s: source answering again", watcher.name)
            state.polls += 1
            state.failures = 0
            state.last_poll_at = started
            state.last_ok_at = started
            state.last_error = None
            state.last_error_kind = None
        for notice in notices:
            self._deliver(notice, state=state)
        return True

    def _record_failure(self, state: WatcherState, started: float, kind: str, msg: str) -> None:
        with self._lock:
            state.polls += 1
            state.failures += 1
            state.errors += 1
            state.last_poll_at = started
            state.last_error = msg
            state.last_error_kind = kind
            n = state.failures
        # Log the first failure and then every tenth, so a dead service does not flood the log.
        if n == 1 or n % 10 == 0:
            log.warning("watcher %s: poll failed (%d in a row): %s", state.name, n, msg)

    def _deliver(self, notice: Notice, *, state: WatcherState | None) -> bool:
        with self._lock:
            if state is not None:
                state.last_notice = notice
            if notice.key in self._seen:
                return False
            self._seen.add(notice.key)
        log.warning(
            "notice: %s %s event=%s deadline=%s %s",
            notice.provider,
            notice.kind,
            notice.event_id,
            f"{notice.deadline - self._clock():.0f}s" if notice.deadline else "none",
            notice.detail,
        )
        try:
            self._on_notice(notice)
        except Exception:
            log.exception("notice handler failed for %s", notice.key)
        return True

    def _run(self, watcher: Watcher) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            ok = self.poll_once(watcher)
            elapsed = time.monotonic() - t0
            if ok:
                wait = max(0.0, watcher.poll_interval - elapsed)
            else:
                failures = self._states[watcher.name].failures
                base = max(watcher.poll_interval, 0.5)
                wait = min(self._max_backoff, base * 2 ** min(failures - 1, 16))
            self._stop.wait(wait)
