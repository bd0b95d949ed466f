"""The notify protocol against a real AF_UNIX datagram socket set as NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.infra import sdnotify
from gpusnap.daemon.infra.sdnotify import LoopHealth, Notifier, Watchdog, watchdog_interval

RECV_TIMEOUT_S = 10.0  # generous: only bounds a hang, never measures anything


class Receiver:
    """A bound datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str | bytes, env_value: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(RECV_TIMEOUT_S)
        self.env_value = env_value

    def recv(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n"))

    def pending(self) -> list[bytes]:
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(4096))
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(RECV_TIMEOUT_S)
        return out


@pytest.fixture
def path_receiver(tmp_path: Path) -> Iterator[Receiver]:
    path = tmp_path / "notify.sock"
    r = Receiver(str(path), str(path))
    yield r
    r.sock.close()


@pytest.fixture
def abstract_receiver() -> Iterator[Receiver]:
    name = f"gpusnap-test-notify-{os.getpid()}-{threading.get_ident()}"
    r = Receiver("\0" + name, "@" + name)
    yield r
    r.sock.close()


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest) -> Receiver:
    name = "path_receiver" if request.param == "path" else "abstract_receiver"
    r: Receiver = request.getfixturevalue(name)
    return r


def test_ready_status_stopping_extend_timeout(receiver: Receiver) -> None:
    n = Notifier(receiver.env_value)
    assert n.ready("serving on unix:/run/gpusnap/gpusnapd.sock")
    assert receiver.recv() == {
        "READY": "1",
        "STATUS": "serving on unix:/run/gpusnap/gpusnapd.sock",
    }
    assert n.status("checkpointing llm: upload 40%")
    assert receiver.recv() == {"STATUS": "checkpointing llm: upload 40%"}
    assert n.extend_timeout(30_000_000)
    assert receiver.recv() == {"EXTEND_TIMEOUT_USEC": "30000000"}
    assert n.stopping()
    assert receiver.recv() == {"STOPPING": "1"}
    assert n.watchdog()
    assert receiver.recv() == {"WATCHDOG": "1"}


def test_module_level_helpers_read_notify_socket(
    path_receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdnotify, "_DEFAULT", Notifier(path_receiver.env_value))
    assert sdnotify.ready()
    assert path_receiver.recv() == {"READY": "1"}
    assert sdnotify.notify(STATUS="x", X_GPUSNAP_JOBS=2)
    assert path_receiver.recv() == {"STATUS": "x", "X_GPUSNAP_JOBS": "2"}


def test_environment_variable_is_the_default(
    path_receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", path_receiver.env_value)
    assert Notifier().status("hello")
    assert path_receiver.recv() == {"STATUS": "hello"}


def test_a_newline_cannot_inject_a_field(path_receiver: Receiver) -> None:
    Notifier(path_receiver.env_value).status("line one\nREADY=1")
    assert path_receiver.recv() == {"STATUS": "line one READY=1"}


def test_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    assert not n.ready()
    assert not n.watchdog()


def test_a_vanished_socket_is_logged_not_raised(tmp_path: Path) -> None:
    assert not Notifier(str(tmp_path / "gone.sock")).ready()


def test_extend_timeout_rejects_nonsense(path_receiver: Receiver) -> None:
    with pytest.raises(ValueError):
        Notifier(path_receiver.env_value).extend_timeout(0)


def test_watchdog_interval_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "junk")
    assert watchdog_interval() is None


def test_watchdog_tick_pings_only_while_healthy(path_receiver: Receiver) -> None:
    healthy = [True]
    dog = Watchdog(Notifier(path_receiver.env_value), lambda: healthy[0], interval=30.0)
    assert dog.tick()
    assert path_receiver.recv() == {"WATCHDOG": "1"}
    healthy[0] = False
    assert not dog.tick()
    assert path_receiver.pending() == []
    healthy[0] = True
    assert dog.tick()
    assert path_receiver.recv() == {"WATCHDOG": "1"}


def test_watchdog_health_check_that_raises_withholds_the_ping(path_receiver: Receiver) -> None:
    def broken() -> bool:
        raise RuntimeError("main loop state unreadable")

    assert not Watchdog(Notifier(path_receiver.env_value), broken, interval=30.0).tick()
    assert path_receiver.pending() == []


def test_watchdog_thread_withholds_pings_until_healthy(
    path_receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # 20 ms: ping every 10 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    healthy = threading.Event()
    checks = 0
    three_checks = threading.Event()

    def is_healthy() -> bool:
        nonlocal checks
        checks += 1
        if checks >= 3:
            three_checks.set()
        return healthy.is_set()

    dog = Watchdog(Notifier(path_receiver.env_value), is_healthy)
    assert dog.interval == 0.02
    assert dog.start()
    try:
        assert three_checks.wait(RECV_TIMEOUT_S)
        # Two whole unhealthy checks are done (the third is under way): no ping was sent.
        assert path_receiver.pending() == []
        healthy.set()
        assert path_receiver.recv() == {"WATCHDOG": "1"}
    finally:
        dog.stop()


def test_watchdog_does_not_start_without_a_configured_interval(
    path_receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert not Watchdog(Notifier(path_receiver.env_value), lambda: True).start()


def test_loop_health_follows_the_heartbeat() -> None:
    assert LoopHealth(max_age=3600.0)()
    stale = LoopHealth(max_age=-1.0)  # any beat is already too old
    assert not stale()
