"""systemd's notify protocol (sd_notify(3)) without libsystemd, and a health-tied watchdog.

A message is one ``AF_UNIX`` datagram of newline-separated ``KEY=VALUE`` lines sent to
``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract-namespace address). Without
``$NOTIFY_SOCKET`` — not under systemd, or not ``Type=notify`` — every call is a no-op, and a
failed send is logged, never raised: telling systemd is never worth failing the daemon for.

``Watchdog`` pings ``WATCHDOG=1`` every half ``$WATCHDOG_USEC`` only while a health check
passes; when the main loop stalls, the pings stop and systemd restarts the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Notifier:
    """Sends notify messages to ``address`` (default: ``$NOTIFY_SOCKET`` at construction)."""

    def __init__(self, address: str | None = None) -> None:
        self._address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def _sockaddr(self) -> str | None:
        addr = self._address
        if addr.startswith("@"):
            return "\0" + addr[1:]
        if addr.startswith("/"):
            return addr
        # vsock:CID:PORT (VMs) and anything else we do not speak.
        log.warning("unsupported NOTIFY_SOCKET %r; not notifying systemd", addr)
        return None

    def send(self, message: str) -> bool:
        """Send a raw message; True when it was handed to the socket."""
        if not self._address:
            return False
        target = self._sockaddr()
        if target is None:
            return False
        try:
            with (
                self._lock,
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock,
            ):
                sock.connect(target)
                sock.sendall(message.encode())
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._address, exc)
            return False
        return True

    def notify(self, **fields: object) -> bool:
        """``notify(READY=1, STATUS="serving")`` -> ``READY=1\\nSTATUS=serving``."""
        lines = []
        for key, value in fields.items():
            text = "1" if value is True else str(value)
            # One line per field: a newline in a value would start a bogus field.
            lines.append(f"{key}={' '.join(text.splitlines())}")
        return self.send("\n".join(lines))

    def ready(self, status: str | None = None) -> bool:
        """The daemon serves now (send only once the API socket accepts calls)."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        """One line shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def stopping(self, status: str | None = None) -> bool:
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, usec: int) -> bool:
        """Ask for ``usec`` more before the current start/stop timeout; repeat within it."""
        if usec <= 0:
            raise ValueError(f"EXTEND_TIMEOUT_USEC must be positive, not {usec}")
        return self.notify(EXTEND_TIMEOUT_USEC=int(usec))


_DEFAULT = Notifier()


def notify(**fields: object) -> bool:
    """Send ``fields`` to ``$NOTIFY_SOCKET`` as read when this module was imported."""
    return _DEFAULT.notify(**fields)


def ready(status: str | None = None) -> bool:
    return _DEFAULT.ready(status)


def status(text: str) -> bool:
    return _DEFAULT.status(text)


def stopping(status: str | None = None) -> bool:
    return _DEFAULT.stopping(status)


def watchdog() -> bool:
    return _DEFAULT.watchdog()


def extend_timeout(usec: int) -> bool:
    return _DEFAULT.extend_timeout(usec)


def watchdog_interval() -> float | None:
    """systemd's watchdog timeout in seconds, or None when it is off or meant for another pid.

    Reads ``$WATCHDOG_USEC`` and, when set, ``$WATCHDOG_PID`` (which must be this process).
    """
    usec_text = os.environ.get("WATCHDOG_USEC", "")
    if not usec_text:
        return None
    pid_text = os.environ.get("WATCHDOG_PID", "")
    if pid_text:
        try:
            if int(pid_text) != os.getpid():
                return None
        except ValueError:
            log.warning("ignoring malformed WATCHDOG_PID=%r", pid_text)
            return None
    try:
        usec = int(usec_text)
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r", usec_text)
        return None
    return usec / 1e6 if usec > 0 else None


class LoopHealth:
    """A heartbeat the main loop calls each turn; healthy while the last beat is recent."""

    def __init__(self, max_age: float) -> None:
        self._max_age = max_age
        self._last = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()

    def __call__(self) -> bool:
        return time.monotonic() - self._last <= self._max_age


class Watchdog:
    """Pings ``WATCHDOG=1`` every ``interval / 2`` while ``healthy()`` returns True.

    ``interval`` defaults to ``watchdog_interval()``; with no watchdog configured ``start``
    does nothing. A ``healthy`` that raises counts as unhealthy.
    """

    def __init__(
        self,
        notifier: Notifier,
        healthy: Callable[[], bool],
        *,
        interval: float | None = None,
    ) -> None:
        self._notifier = notifier
        self._healthy = healthy
        self._interval = interval if interval is not None else watchdog_interval()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._was_healthy = True

    @property
    def interval(self) -> float | None:
        return self._interval

    def tick(self) -> bool:
        """One check: ping if healthy. Returns whether a ping was sent."""
        try:
            ok = bool(self._healthy())
        except Exception:
            log.exception("watchdog health check raised; not pinging")
            ok = False
        if not ok:
            if self._was_healthy:
                log.error("main loop unhealthy: withholding watchdog pings")
            self._was_healthy = False
            return False
        if not self._was_healthy:
            log.info("main loop healthy again: resuming watchdog pings")
        self._was_healthy = True
        return self._notifier.watchdog()

    def _run(self) -> None:
        assert self._interval is not None
        period = self._interval / 2
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(period)

    def start(self) -> bool:
        """Start pinging in a daemon thread; False when no watchdog is configured."""
        if self._interval is None or not self._notifier.enabled:
            return False
        if self._thread is not None:
            return True
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
