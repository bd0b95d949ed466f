"""logind PrepareForShutdown and the delay lock, against a fake logind on a private D-Bus bus.

The bus is a real ``dbus-daemon`` (Debian package ``dbus``) on a socket in the test's tmp
directory; the fake logind owns ``org.freedesktop.login1`` on it, hands out a real pipe as the
inhibitor fd and sees the lock released when every copy of that fd is closed — as logind does.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.jobs.job import JobState
from gpusnap.daemon.reclaim.config import WorkloadPolicy
from gpusnap.daemon.reclaim.notice import Notice
from gpusnap.daemon.reclaim.policy import PolicyEngine
from gpusnap.daemon.reclaim.shutdown import LogindInhibitor, StopTimeoutExtender
from gpusnap.errors import Unavailable
from tests.reclaim.fakes import FakeNode

jeepney = pytest.importorskip("jeepney")
from jeepney import DBusAddress, HeaderFields, MessageType, new_method_return, new_signal  # noqa: E402
from jeepney.bus_messages import message_bus  # noqa: E402
from jeepney.io.blocking import open_dbus_connection  # noqa: E402

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("dbus-daemon") is None, reason="needs dbus-daemon (apt: dbus)"),
]

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={path}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[str]:
    sock = tmp_path / "bus.sock"
    conf = tmp_path / "bus.conf"
    conf.write_text(BUS_CONFIG.format(path=sock))
    proc = subprocess.Popen(
        ["dbus-daemon", "--nofork", f"--config-file={conf}", "--nopidfile"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"unix:path={sock}"
    try:
        # The socket file appears at bind(), before the bus accepts: wait for a connection.
        end = time.monotonic() + 10
        while True:
            try:
                open_dbus_connection(address).close()
                break
            except (OSError, ValueError):
                if time.monotonic() > end:
                    raise AssertionError("dbus-daemon did not start") from None
                time.sleep(0.02)
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


class FakeLogind:
    """Owns org.freedesktop.login1; serves Inhibit and the InhibitDelayMaxUSec property."""

    def __init__(self, address: str, delay_usec: int = 7_000_000) -> None:
        self.conn = open_dbus_connection(address, enable_fds=True)
        self.conn.send_and_get_reply(message_bus.RequestName("org.freedesktop.login1"))
        self.delay_usec = delay_usec
        self.inhibits: list[tuple[str, ...]] = []
        self.read_ends: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.conn.receive(timeout=0.2)
            except TimeoutError:
                continue
            except OSError:
                return
            if msg.header.message_type != MessageType.method_call:
                continue
            member = msg.header.fields.get(HeaderFields.member)
            if member == "Inhibit":
                self.inhibits.append(tuple(msg.body))
                r, w = os.pipe()
                self.read_ends.append(r)
                self.conn.send(new_method_return(msg, "h", (w,)))
                os.close(w)
            elif member == "Get":
                self.conn.send(new_method_return(msg, "v", (("t", self.delay_usec),)))

    def lock_open(self, index: int = -1) -> bool:
        """False once the holder closed every copy of the inhibitor fd (EOF on the pipe)."""
        r = self.read_ends[index]
        ready, _, _ = select.select([r], [], [], 0)
        return not ready

    def prepare_for_shutdown(self, starting: bool) -> None:
        addr = DBusAddress("/org/freedesktop/login1", interface="org.freedesktop.login1.Manager")
        self.conn.send(new_signal(addr, "PrepareForShutdown", "b", (starting,)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.conn.close()
        for r in self.read_ends:
            os.close(r)


def wait_for(cond: Any, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def test_lock_is_held_while_the_reclaim_runs_and_released_after(bus: str) -> None:
    logind = FakeLogind(bus)
    node = FakeNode()
    engine = PolicyEngine(node, [WorkloadPolicy("llm")])
    notices: list[Notice] = []

    def on_notice(n: Notice) -> None:
        notices.append(n)
        engine.on_notice(n)

    inhibitor = LogindInhibitor(on_notice, bus_address=bus)
    try:
        inhibitor.start()
        assert logind.inhibits == [
            ("shutdown", "gpusnapd", inhibitor.why, "delay"),
        ]
        assert inhibitor.delay_max_s == 7.0
        assert inhibitor.held and logind.lock_open()
        logind.prepare_for_shutdown(True)
        (call,) = node.wait_calls(1)
        assert call.trigger == "shutdown:node" and call.leave_running is False
        (notice,) = notices
        assert notice.deadline == pytest.approx(notice.received_at + 7.0)
        time.sleep(0.3)
        assert logind.lock_open()  # checkpoint still running: shutdown stays delayed
        node.finish(call.job_id)
        assert wait_for(lambda: not logind.lock_open())
        assert not inhibitor.held
        # A cancelled shutdown takes the lock again.
        logind.prepare_for_shutdown(False)
        assert wait_for(lambda: len(logind.inhibits) == 2)
        assert wait_for(lambda: inhibitor.held)
        assert logind.lock_open()
    finally:
        inhibitor.close()
        logind.close()


def test_lock_is_released_even_when_the_checkpoint_fails(bus: str) -> None:
    logind = FakeLogind(bus)
    node = FakeNode(auto={"kill": JobState.FAILED})
    engine = PolicyEngine(node, [WorkloadPolicy("llm")])
    inhibitor = LogindInhibitor(engine.on_notice, bus_address=bus)
    try:
        inhibitor.start()
        logind.prepare_for_shutdown(True)
        assert wait_for(lambda: not logind.lock_open())
        assert len(node.calls) == 1
    finally:
        inhibitor.close()
        logind.close()


def test_no_bus_is_unavailable(tmp_path: Path) -> None:
    inhibitor = LogindInhibitor(lambda n: None, bus_address=f"unix:path={tmp_path / 'none'}")
    with pytest.raises(Unavailable):
        inhibitor.start()


def test_extender_pings_while_busy_and_stops_after() -> None:
    pings: list[int] = []
    busy = threading.Event()
    busy.set()
    ext = StopTimeoutExtender(pings.append, busy.is_set, step_s=0.2)
    threading.Timer(0.5, busy.clear).start()
    assert ext.run(timeout=10) is True
    assert len(pings) >= 2
    assert set(pings) == {200_000}
    n = len(pings)
    assert ext.run(timeout=10) is True
    assert len(pings) == n  # not busy: no ping
