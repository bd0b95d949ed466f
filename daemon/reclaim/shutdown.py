"""Node shutdown as a trigger: logind's PrepareForShutdown, SIGTERM, and stop-time extension.

logind (systemd ``INHIBITOR_LOCKS``): the daemon takes a *delay* inhibitor lock for
``shutdown`` at start — ``org.freedesktop.login1.Manager.Inhibit("shutdown", who, why,
"delay")`` returns a file descriptor, and the lock lives as long as that descriptor is open.
When a shutdown begins, logind emits ``PrepareForShutdown(true)`` and waits, at most
``InhibitDelayMaxUSec``, for delay locks to close. We turn the signal into a ``shutdown``
notice whose ``on_done`` closes the descriptor, so the lock is held exactly while the reclaim
checkpoints it started (or attached to) run. ``PrepareForShutdown(false)`` (a cancelled
shutdown) takes the lock again. Watching the signal without holding a lock would be racy.

SIGTERM: systemd stops the daemon both for a node shutdown and for a plain
``systemctl stop``; only the first should checkpoint workloads in kill mode. ``system_is_stopping``
tells them apart (logind's ``PreparingForShutdown``, else ``systemctl is-system-running``).

``StopTimeoutExtender`` keeps sending ``EXTEND_TIMEOUT_USEC`` (through a callable, e.g.
``gpusnap.daemon.infra.sdnotify.extend_timeout``) while a reclaim checkpoint runs during stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from gpusnap.daemon.reclaim.notice import Notice
from gpusnap.errors import Unavailable, Unsupported

log = logging.getLogger(__name__)

LOGIND_NAME = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
LOGIND_IFACE = "org.freedesktop.login1.Manager"
DEFAULT_DELAY_S = 5.0  # logind's default InhibitDelayMaxSec


def _jeepney() -> Any:
    try:
        import jeepney  # noqa: PLC0415 - optional until logind is used
        import jeepney.io.blocking  # noqa: PLC0415
    except ImportError as exc:
        raise Unsupported("logind integration needs the 'jeepney' package") from exc
    return jeepney


class LogindInhibitor:
    """Holds a shutdown delay lock and turns ``PrepareForShutdown(true)`` into a notice."""

    def __init__(
        self,
        on_notice: Callable[[Notice], object],
        *,
        bus_address: str = "SYSTEM",
        who: str = "gpusnapd",
        why: str = "checkpointing GPU workloads before the node goes away",
        call_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._on_notice = on_notice
        self._bus_address = bus_address
        self.who = who
        self.why = why
        self._timeout = call_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._fd: Any = None  # jeepney FileDescriptor while the lock is held
        self._conn: Any = None
        self._listen_conn: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shutdowns = 0
        self.delay_max_s = DEFAULT_DELAY_S

    def _manager(self) -> Any:
        j = _jeepney()
        return j.DBusAddress(LOGIND_PATH, bus_name=LOGIND_NAME, interface=LOGIND_IFACE)

    def _call(self, msg: Any) -> Any:
        j = _jeepney()
        try:
            reply = self._conn.send_and_get_reply(msg, timeout=self._timeout)
        except (OSError, TimeoutError) as exc:
            raise Unavailable(f"logind: {type(exc).__name__}: {exc}") from exc
        if reply.header.message_type == j.MessageType.error:
            raise Unavailable(f"logind: {reply.header.fields.get(j.HeaderFields.error_name)}")
        return reply.body

    def _property(self, name: str) -> Any:
        j = _jeepney()
        body = self._call(j.Properties(self._manager()).get(name))
        return body[0][1]

    def start(self) -> None:
        """Connect, read the delay budget, take the lock and listen; ``Unavailable`` if no bus."""
        j = _jeepney()
        try:
            self._conn = j.io.blocking.open_dbus_connection(self._bus_address, enable_fds=True)
            self._listen_conn = j.io.blocking.open_dbus_connection(self._bus_address)
        except (OSError, ValueError, KeyError) as exc:
            self.close()
            raise Unavailable(f"logind: no D-Bus system bus: {exc}") from exc
        try:
            self.delay_max_s = int(self._property("InhibitDelayMaxUSec")) / 1e6
        except Unavailable as exc:
            log.warning("logind: cannot read InhibitDelayMaxUSec (%s); assuming 5 s", exc)
        rule = j.MatchRule(
            type="signal",
            sender=LOGIND_NAME,
            interface=LOGIND_IFACE,
            member="PrepareForShutdown",
            path=LOGIND_PATH,
        )
        from jeepney.bus_messages import message_bus  # noqa: PLC0415

        self._listen_conn.send_and_get_reply(message_bus.AddMatch(rule), timeout=self._timeout)
        self.take_lock()
        self._thread = threading.Thread(target=self._listen, name="logind", daemon=True)
        self._thread.start()
        log.info(
            "logind: holding a shutdown delay lock (InhibitDelayMaxSec %.0f s)", self.delay_max_s
        )

    @property
    def held(self) -> bool:
        with self._lock:
            return self._fd is not None

    def take_lock(self) -> None:
        j = _jeepney()
        with self._lock:
            if self._fd is not None:
                return
        msg = j.new_method_call(
            self._manager(), "Inhibit", "ssss", ("shutdown", self.who, self.why, "delay")
        )
        (fd,) = self._call(msg)
        with self._lock:
            self._fd = fd

    def release_lock(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            fd.close()
            log.info("logind: shutdown delay lock released")

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self._listen_conn.receive(timeout=0.5)
            except TimeoutError:
                continue
            except (OSError, ValueError) as exc:
                if not self._stop.is_set():
                    log.warning("logind: listening stopped: %s", exc)
                return
            try:
                self._handle(msg)
            except Exception:
                log.exception("logind: handling a signal failed")

    def _handle(self, msg: Any) -> None:
        j = _jeepney()
        hdr = msg.header
        if hdr.message_type != j.MessageType.signal:
            return
        if hdr.fields.get(j.HeaderFields.member) != "PrepareForShutdown":
            return
        (starting,) = msg.body
        if not starting:
            log.info("logind: shutdown cancelled; taking the delay lock again")
            self.take_lock()
            return
        self._shutdowns += 1
        now = self._clock()
        notice = Notice(
            provider="node",
            kind="shutdown",
            deadline=now + self.delay_max_s,
            event_id=f"logind-{self._shutdowns}",
            detail="logind PrepareForShutdown(true)",
            received_at=now,
            on_done=self.release_lock,
        )
        self._on_notice(notice)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self.release_lock()
        for conn in (self._conn, self._listen_conn):
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
        self._conn = self._listen_conn = None


def system_is_stopping(*, timeout: float = 2.0) -> bool:
    """True when the whole system is going down (so SIGTERM means "the node goes away")."""
    if os.path.exists("/run/nologin") and os.path.exists("/run/systemd/shutdown/scheduled"):
        return True
    try:
        out = subprocess.run(
            ["systemctl", "is-system-running"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out == "stopping"


def sigterm_notice(stop_budget_s: float, *, clock: Callable[[], float] = time.time) -> Notice:
    """The notice for a SIGTERM received while the system stops."""
    now = clock()
    return Notice(
        provider="node",
        kind="shutdown",
        deadline=now + stop_budget_s,
        event_id="sigterm",
        detail="SIGTERM while the system is stopping",
        received_at=now,
    )


class StopTimeoutExtender:
    """While ``busy()``, call ``extend_timeout(usec)`` every half step (systemd stop timeout)."""

    def __init__(
        self,
        extend_timeout: Callable[[int], object],
        busy: Callable[[], bool],
        *,
        step_s: float = 30.0,
    ) -> None:
        self._extend = extend_timeout
        self._busy = busy
        self.step_s = step_s
        self._stop = threading.Event()

    def run(self, timeout: float) -> bool:
        """Block until not busy (True) or ``timeout`` seconds passed (False)."""
        end = time.monotonic() + timeout
        while self._busy():
            left = end - time.monotonic()
            if left <= 0 or self._stop.is_set():
                return False
            try:
                self._extend(int(self.step_s * 1e6))
            except Exception:
                log.exception("EXTEND_TIMEOUT_USEC failed")
            self._stop.wait(min(left, self.step_s / 2, 0.5))
        return True

    def stop(self) -> None:
        self._stop.set()
