"""Journal streams: a tree's stdout on a stream socket to journald, found, dumped as external
and restored onto a new stream, against a real listening socket standing in for journald."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.host import journalstream, proctree
from gpusnap.daemon.host.criu import OPTIONS_FILE, Criu
from gpusnap.errors import InvalidArgument
from tests.support import workloads
from tests.support.criu import criu_or_skip

RECV_TIMEOUT_S = 30.0  # a hang guard only
HEADER_LINES = 7  # identifier, unit, priority, level prefix, syslog, kmsg, console

PRINTER = """
import itertools, sys, time
for i in itertools.count():
    print(i, flush=True)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(i))
    import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.05)
"""


@pytest.fixture
def journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A listening stream socket where journald's stdout socket would be."""
    path = tmp_path / "stdout"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    listener.settimeout(RECV_TIMEOUT_S)
    monkeypatch.setattr(journalstream, "JOURNAL_STDOUT", str(path))
    yield listener
    listener.close()


@pytest.fixture
def criu() -> Iterator[Criu]:
    found = criu_or_skip()
    workloads.set_child_subreaper(True)
    yield found
    workloads.set_child_subreaper(False)


def _printer(journal: socket.socket, count: Path) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A process whose stdout is a stream connection to ``journal``; our end of it. It also
    keeps its last number in ``count``, which says it runs whether or not its output goes
    anywhere."""
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    out.connect(journal.getsockname())
    ours, _ = journal.accept()
    ours.settimeout(RECV_TIMEOUT_S)
    proc = subprocess.Popen(
        [sys.executable, "-c", PRINTER, str(count)],
        stdout=out.fileno(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    out.close()
    return proc, ours


def _read_until(sock: socket.socket, done: bytes, data: bytes = b"") -> bytes:
    while done not in data:
        chunk = sock.recv(4096)
        assert chunk, f"stream closed before {done!r}: {data!r}"
        data += chunk
    return data


def _header_and_lines(sock: socket.socket, until: int) -> tuple[list[bytes], list[int]]:
    """A new stream's header, then the numbers written on it, read up to ``until``."""
    data = b""
    while True:
        lines = data.split(b"\n")
        numbers = [int(x) for x in lines[HEADER_LINES:-1]] if len(lines) > HEADER_LINES else []
        if until in numbers:
            return lines[:HEADER_LINES], numbers
        chunk = sock.recv(4096)
        assert chunk, f"stream closed before {until}: {data!r}"
        data += chunk


def _kill(proc: subprocess.Popen[bytes]) -> None:
    workloads.kill_tree(proc.pid)
    try:
        os.waitpid(proc.pid, 0)
    except ChildProcessError:
        pass


def test_find_names_the_stdout_stream_to_the_journal_and_nothing_else(
    journal: socket.socket, tmp_path: Path
) -> None:
    proc, ours = _printer(journal, tmp_path / "count")
    try:
        _read_until(ours, b"\n")
        (stream,) = journalstream.find(proctree.tree_pids(proc.pid))
        fd1 = os.readlink(f"/proc/{proc.pid}/fd/1")
        assert fd1 == f"socket:[{stream.ino}]"
        assert stream.identifier.startswith("python")
        # Our end of it, accepted on the listener, is not a stream *to* the journal.
        assert journalstream.find([os.getpid()]) == []
    finally:
        proc.kill()
        proc.wait()
        ours.close()


def test_connect_sends_the_stream_header_journald_expects(journal: socket.socket) -> None:
    stream = journalstream.JournalStream(ino=1, identifier="vllm", unit="vllm.service")
    with socket.socket(fileno=journalstream.connect(stream)) as sock:
        peer, _ = journal.accept()
        peer.settimeout(RECV_TIMEOUT_S)
        sock.sendall(b"hello\n")
        assert _read_until(peer, b"hello\n") == b"vllm\nvllm.service\n6\n1\n0\n0\n0\nhello\n"
        peer.close()


def test_without_a_journal_the_new_stream_is_dev_null_not_a_broken_pipe(tmp_path: Path) -> None:
    stream = journalstream.JournalStream(ino=1, identifier="vllm", unit="vllm.service")
    fd = journalstream.connect(stream, listener=str(tmp_path / "nobody-listens"))
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(os.devnull))
        assert os.write(fd, b"dropped\n") == 8
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "entry",
    [
        {"ino": 5, "identifier": "a\nb", "unit": ""},  # a newline would end the header early
        {"ino": 5, "identifier": "a\0", "unit": ""},  # so would a NUL
        {"ino": 5, "identifier": "x" * 300, "unit": ""},
        {"ino": True, "identifier": "a", "unit": ""},
        {"ino": 5, "identifier": "a"},
        {"ino": 5, "identifier": "a", "unit": "", "extra": 1},
        "not a dict",
    ],
)
def test_a_recorded_stream_that_would_break_the_header_is_refused(
    entry: object, tmp_path: Path
) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "inventory.img").write_bytes(b"")
    (images / OPTIONS_FILE).write_text(json.dumps({"journal_streams": [entry]}))
    with pytest.raises(InvalidArgument, match="journal"):
        Criu("/bin/true").restore(images, log_path=tmp_path / "r.log", pidfile=tmp_path / "p")


@pytest.mark.criu
def test_a_tree_writing_to_the_journal_is_dumped_and_restored_onto_a_new_stream(
    journal: socket.socket, criu: Criu, tmp_path: Path
) -> None:
    proc, ours = _printer(journal, tmp_path / "count")
    try:
        before = _read_until(ours, b"3\n")
        criu.dump(proc.pid, tmp_path / "images", leave_running=False, log_path=tmp_path / "d")
        proc.wait()
        while chunk := ours.recv(1 << 16):  # all it wrote before the dump, then EOF
            before += chunk
        last = int(before.split()[-1])
        restored = criu.restore(
            tmp_path / "images",
            log_path=tmp_path / "restore.log",
            pidfile=tmp_path / "restored.pid",
            sibling=True,
        )
        assert restored.pid == proc.pid
        new, _ = journal.accept()
        new.settimeout(RECV_TIMEOUT_S)
        header, numbers = _header_and_lines(new, until=last + 3)
        assert header[2:4] == [b"6", b"1"]  # priority, level prefix
        assert header[0].startswith(b"python")
        assert numbers[0] == last + 1  # counting on where it was, not from 0
        new.close()
    finally:
        _kill(proc)
        ours.close()


@pytest.mark.criu
def test_a_tree_restored_where_no_journal_listens_runs_on(
    journal: socket.socket, criu: Criu, tmp_path: Path
) -> None:
    count = tmp_path / "count"
    proc, ours = _printer(journal, count)
    try:
        _read_until(ours, b"3\n")
        criu.dump(proc.pid, tmp_path / "images", leave_running=False, log_path=tmp_path / "d")
        proc.wait()
        path = Path(journal.getsockname())
        journal.close()
        path.unlink()  # journald gone
        at_restore = int(count.read_text())
        criu.restore(
            tmp_path / "images",
            log_path=tmp_path / "restore.log",
            pidfile=tmp_path / "restored.pid",
            sibling=True,
        )
        # It prints every step: with a broken pipe for stdout it would die at the first.
        workloads._poll(
            lambda: int(count.read_text()) >= at_restore + 5, 60, "the restored printer"
        )
        assert proctree.exists(proc.pid)
    finally:
        _kill(proc)
        ours.close()
