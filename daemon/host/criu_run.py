"""One run of the criu binary, as a child of gpusnapd that never outlives it unnoticed.

A dump dies with the daemon. ``criu dump`` holds the tree seized (kill mode: it kills the tree
once the images are written); orphaned by a daemon that died, it would finish, kill the tree,
and leave images nobody uploads. So a dump runs under ``setpriv --pdeathsig KILL`` (util-linux:
``PR_SET_PDEATHSIG`` set in C before criu is exec'd, which keeps it): the kernel kills it when
the thread that started it dies, however the daemon dies. (Not a ``preexec_fn``: Python code in
the forked child of this multi-threaded daemon runs gRPC's fork handlers, which broke the child
now and then: criu never ran.) What that leaves was measured with criu 4.1.1 (SIGKILL at
0.05 to 1 s into the dump of a 400 MiB process, before and during the page transfer): the
tracer's death detaches the tree and CRIU's parasite code in it returns to the interrupted
context, so the tree runs on, unharmed; only once CRIU has reached its kill stage (after every
image is written and flushed) is the tree gone, and then the images are complete.
``daemon/pipelines/recovery.py`` tells these apart at the next start.

A restore is left to finish. Measured the same way, a ``criu restore`` killed after the tree
was forked leaves its processes hung in CRIU's restorer (alive, holding their pids, never
resuming), which would lose the workload and block every later restore of it. Orphaned, it
completes and detaches as it would have anyway; the next daemon waits for it before it
touches the job's staging, and reports what it restored.

Either way the run leaves a record, ``criu-run.json`` in its working directory (the job's
staging), naming the criu process (pid and start time) until it has exited, so the next
daemon can tell a leftover criu from a reused pid. stdout/stderr go to files, never pipes a
restored tree could inherit.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.criu_plugins import criu_env

log = logging.getLogger(__name__)

RUN_RECORD = "criu-run.json"
_KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class RunRecord:
    """The criu process of a job, as the record in its staging names it."""

    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat), with ``pid`` its identity
    what: str  # "dump", "restore"

    def running(self) -> bool:
        return proctree.exists(self.pid) and proctree.start_time(self.pid) == self.start

    @classmethod
    def read(cls, workdir: Path) -> RunRecord | None:
        try:
            data = json.loads((workdir / RUN_RECORD).read_text())
            return cls(int(data["pid"]), int(data["start"]), str(data["what"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def run(
    argv: list[str],
    workdir: Path,
    out_path: Path,
    timeout: float | None,
    *,
    what: str,
    die_with_daemon: bool,
    pass_fds: tuple[int, ...] = (),
) -> tuple[int | None, str]:
    """Run ``argv`` in a new session in ``workdir`` (stdout and stderr to ``out_path``).

    Returns its exit status (None when it ran past ``timeout`` and was stopped) and its output.
    ``die_with_daemon``: the kernel kills it if the calling thread dies first.
    """
    record = workdir / RUN_RECORD
    if die_with_daemon:
        argv = [*_die_with_parent(), *argv]
    with open(out_path, "w+b") as out, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            argv,
            stdin=devnull,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
            env=criu_env(),
        )
        _write_record(record, proc.pid, what)
        try:
            try:
                rc: int | None = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stop(proc)
                rc = None
        finally:
            record.unlink(missing_ok=True)
        out.seek(0)
        return rc, out.read().decode(errors="replace")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT lets criu unwind (thaw or detach from the tree); SIGKILL only if it will not."""
    for sig, grace in ((signal.SIGINT, _KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue


@functools.cache
def _die_with_parent() -> tuple[str, ...]:
    """The prefix that makes a command die with the thread that starts it: ``setpriv``'s, or
    none (and a warning, once) where util-linux's setpriv is missing."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        log.warning(
            "setpriv (util-linux) not found: a criu dump may outlive gpusnapd if it dies "
            "mid-dump, and kill the workload after; install util-linux"
        )
        return ()
    return (setpriv, "--pdeathsig", "KILL", "--")


def _write_record(path: Path, pid: int, what: str) -> None:
    start = proctree.start_time(pid)
    if start is None:
        return  # it has already exited: nothing to find later
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"pid": pid, "start": start, "what": what}) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot record criu's pid in %s: %s", path, exc)
