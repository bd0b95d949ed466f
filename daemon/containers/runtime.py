"""The one interface every container runtime offers gpusnap, and what they share.

A runtime is driven through its own command-line tool (``podman``, ``runc``, ``ctr``), never
through a library, so that the layer needs nothing but the binaries the node already runs. Each
call runs with CRIU's directory first on ``PATH``: the runtimes look ``criu`` up there, and on
Debian 12 the one that works is scripts/install-criu.sh's ``/usr/local/sbin/criu``, not
Debian's 3.17.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers.archive import Arrivals
from gpusnap.daemon.containers.model import (
    CheckpointParts,
    ContainerInfo,
    ContainerSpec,
    Dumped,
    write_parts,
)
from gpusnap.daemon.containers.openfiles import fit_parts
from gpusnap.daemon.host.openfiles import Fitted
from gpusnap.daemon.host.proctree import cgroup_limits, host_pids
from gpusnap.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    GpusnapError,
    Internal,
    NotFound,
    Unsupported,
)

log = logging.getLogger(__name__)

DEFAULT_CRIU = Path("/usr/local/sbin/criu")  # scripts/install-criu.sh
DEFAULT_TIMEOUT = 600.0  # a hang guard on one runtime call, never a performance expectation


class ContainerRuntime(ABC):
    """A container runtime gpusnap can checkpoint through. One object per runtime and storage
    root; its methods are safe to call from the daemon's job threads one container at a time.
    """

    name: str
    min_version: tuple[int, ...]  # the oldest release gpusnap drives
    version_args: tuple[str, ...] = ("--version",)  # what makes the tool print its version
    tool: RuntimeTool

    def version(self) -> str:
        """The runtime's version ("4.3.1"); ``Unsupported`` when missing or too old."""
        return self.tool.version(self.version_args, self.min_version)

    @abstractmethod
    def inspect(self, ref: str) -> ContainerInfo:
        """The container ``ref`` (name or id): ids, host pids, image, spec, cgroup limits.
        ``NotFound`` when this runtime has no such container."""

    def _container(
        self,
        *,
        id: str,
        name: str,
        init_pid: int,
        running: bool,
        spec: ContainerSpec,
        image_digests: tuple[str, ...] = (),
    ) -> ContainerInfo:
        """What ``inspect`` returns for a container whose init is ``init_pid``, as the runtime
        said it is: its host pids and cgroup limits read now, running only while it has
        processes."""
        pids, limits = live_facts(init_pid, running)
        return ContainerInfo(
            id=id,
            name=name,
            runtime=self.name,
            runtime_version=self.version(),
            running=running and bool(pids),
            pids=pids,
            spec=spec,
            cgroup_limits=limits,
            image_digests=image_digests,
        )

    def checkpoint(
        self,
        ref: str,
        dest: Path,
        *,
        leave_running: bool,
        info: ContainerInfo | None = None,
        arrivals: Arrivals | None = None,
    ) -> CheckpointParts:
        """Checkpoint the running container into ``dest`` (created; must not exist) as parts.

        Without ``leave_running`` the container is stopped by the checkpoint. The caller has
        already frozen the GPU state of ``inspect(ref).pids`` (``info``: that inspection, which
        the record then holds, instead of asking the runtime again). ``arrivals``, where the
        runtime exports an archive (podman, containerd), hears of each file as it arrives in
        ``dest``, so an upload can follow it (runc: CRIU writes ``dest`` itself; nothing is
        said). ``FailedPrecondition`` when the container is not running or exits meanwhile;
        nothing is left in ``dest`` on failure.
        """
        info = info or self.inspect(ref)
        if not info.running:
            raise FailedPrecondition(f"{self.name}: container {info.name!r} is not running")
        dest.mkdir(parents=True, exist_ok=False)
        with checkpoint_attempt(self.name, info, dest, lambda: self._still_running(info.id)):
            dumped = self._dump(info, dest, leave_running=leave_running, arrivals=arrivals)
        parts = CheckpointParts(
            directory=dest,
            container=info,
            parts=dumped.parts,
            leave_running=leave_running,
            seconds=dumped.seconds,
            extra=dumped.extra,
        )
        log.info(
            "%s: checkpointed %s in %.2f s (%s)", self.name, info.name, parts.seconds, parts.sizes()
        )
        return write_parts(parts)

    @abstractmethod
    def _dump(
        self, info: ContainerInfo, dest: Path, *, leave_running: bool, arrivals: Arrivals | None
    ) -> Dumped:
        """The runtime's own checkpoint of the running container ``info`` into ``dest`` (made,
        empty); ``checkpoint`` cleans up after a failure and writes the record."""

    def _still_running(self, ref: str) -> bool:
        """Whether ``ref`` still runs (``NotFound`` when it is gone), asked after a failed
        checkpoint."""
        return self.inspect(ref).running

    def fit_open_files(self, parts: CheckpointParts, *, name: str | None = None) -> list[Fitted]:
        """Before ``restore(parts, name=name)``: the files the container held open in its rw
        layer, cut back to the size CRIU recorded where the layer has them longer (it ran on
        after a leave-running checkpoint; ``openfiles.py``). What was cut."""
        return fit_parts(parts)

    @abstractmethod
    def restore(self, parts: CheckpointParts, *, name: str | None = None) -> ContainerInfo:
        """Restore ``parts`` as a running container named ``name`` (default: the checkpointed
        name) into this runtime's storage. The checkpointed container, stopped, is replaced;
        any other container of that name is ``AlreadyExists``. ``FailedPrecondition`` when the
        image is not present here. Returns the restored container (its new host pids)."""

    def _make_room(self, target: str, rec: ContainerInfo) -> None:
        """Before a restore as ``target``: remove the stopped container the checkpoint ``rec``
        was taken from, so its name is free; refuse to touch anything else."""
        try:
            there = self.inspect(target)
        except NotFound:
            return
        if there.running:
            raise AlreadyExists(
                f"{self.name}: container {target!r} is running; restore under a new name "
                "(--name NEW)"
            )
        if there.id != rec.id:
            raise AlreadyExists(
                f"{self.name}: another container is named {target!r}; restore under a new name "
                "(--name NEW)"
            )
        self._discard(there)

    def _discard(self, stopped: ContainerInfo) -> None:
        """Remove the stopped checkpointed container ``_make_room`` found."""
        self.remove(stopped.id)

    @abstractmethod
    def image_present(self, image_id: str) -> bool:
        """Whether the image ``image_id`` ("sha256:...") is in this runtime's storage."""

    def _require_image(self, rec: ContainerInfo) -> None:
        """``FailedPrecondition`` unless the image of the checkpointed container ``rec`` is
        here: a restore never pulls."""
        if not self.image_present(rec.spec.image_id):
            raise FailedPrecondition(
                f"{self.name}: image {rec.spec.image_id} ({rec.spec.image}) of container "
                f"{rec.name!r} is not present here; gpusnap never pulls images"
            )

    @abstractmethod
    def create(self, spec: ContainerSpec, *, name: str) -> ContainerInfo:
        """Create and start a fresh container from ``spec`` (a cold start); the image must be
        present (gpusnap never pulls)."""

    @abstractmethod
    def remove(self, ref: str) -> None:
        """Stop (SIGKILL) and remove the container ``ref``; nothing when there is none."""


@dataclass
class RuntimeTool:
    """One runtime binary, run with CRIU first on ``PATH`` and errors made ours."""

    label: str  # "podman", for messages
    argv0: str  # the binary, a name on PATH or a path
    base_args: Sequence[str] = ()
    criu: Path = DEFAULT_CRIU
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT
    _version: str | None = field(default=None, init=False, repr=False)

    def binary(self) -> str:
        found = shutil.which(self.argv0)
        if found is None:
            raise Unsupported(
                f"{self.label}: {self.argv0} not found (install it, see "
                "scripts/install-containers.sh)"
            )
        return found

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        path = env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        env["PATH"] = f"{self.criu.parent}:{path}"
        return env

    def run(
        self,
        args: Sequence[str],
        *,
        what: str,
        check: bool = True,
        timeout: float | None = None,
        stdin: int | None = subprocess.DEVNULL,
    ) -> subprocess.CompletedProcess[str]:
        """Run the tool; a non-zero exit raises ``Internal`` with its stderr's last line
        (callers translate the ones they expect)."""
        cmd = [self.binary(), *self.base_args, *args]
        log.debug("%s: %s", self.label, " ".join(cmd))
        try:
            proc = subprocess.run(
                cmd,
                stdin=stdin,
                capture_output=True,
                text=True,
                env=self.environ(),
                timeout=timeout or self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise DeadlineExceeded(
                f"{self.label} {what}: no answer in {exc.timeout:.0f} s"
            ) from exc
        if check and proc.returncode != 0:
            raise Internal(f"{self.label} {what} failed: {last_line(proc.stderr or proc.stdout)}")
        return proc

    def json(self, proc: subprocess.CompletedProcess[str], what: str) -> Any:
        """The JSON a successful call printed; ``Internal`` naming the tool when it printed
        something else (a wrapper, a foreign binary of the same name)."""
        try:
            return json.loads(proc.stdout)
        except ValueError as exc:
            raise Internal(
                f"{self.label} {what}: printed no JSON ({last_line(proc.stdout) or 'nothing'})"
            ) from exc

    def version(self, args: Sequence[str], minimum: tuple[int, ...]) -> str:
        """The version the tool prints for ``args`` (asked once); ``Unsupported`` below
        ``minimum``."""
        if self._version is None:
            proc = self.run(args, what="version", check=False, timeout=60)
            ver = parse_version(proc.stdout + proc.stderr)
            require_version(self.label, ver, minimum)
            self._version = ver
        return self._version


def last_line(text: str) -> str:
    """The most telling line of a tool's failure, for a one-line error: CRIU's first
    ``Error (...)`` line when the tool names CRIU's log ("log file: PATH"), else its last line."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if not lines:
        return "(no output)"
    m = _LOG_FILE.search(text)
    if m:
        criu_error = _criu_error(Path(m.group(1)))
        if criu_error:
            return f"{lines[-1]}: {criu_error}"
    return lines[-1]


_LOG_FILE = re.compile(r"log file:? (/\S+\.log)")


# CRIU "Error" lines that are not the cause: a limit it only tries to raise (no
# CAP_SYS_RESOURCE in a VM's sandbox), and the summaries and teardown after the real one.
_CRIU_NOISE = ("RLIMIT_NOFILE for self", "FAILED", "cgroupd", "Unable to open fd=")


def _criu_error(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    errors = [x.strip() for x in text.splitlines() if "Error (" in x]
    telling = [x for x in errors if not any(n in x for n in _CRIU_NOISE)]
    return (telling or errors or [""])[0]


_VERSION = re.compile(r"(?<![\w.])v?(\d+\.\d+(?:\.\d+)?)")


def parse_version(text: str) -> str:
    """The first dotted version number in a tool's version output ("" when there is none)."""
    m = _VERSION.search(text)
    return m.group(1) if m else ""


def version_tuple(ver: str) -> tuple[int, ...]:
    return tuple(int(x) for x in ver.split(".") if x.isdigit())


def require_version(label: str, ver: str, minimum: tuple[int, ...]) -> None:
    """``Unsupported`` naming the runtime when ``ver`` is unknown or older than ``minimum``."""
    want = ".".join(str(x) for x in minimum)
    if not ver:
        raise Unsupported(f"{label}: cannot tell its version; gpusnap needs {label} >= {want}")
    if version_tuple(ver) < minimum:
        raise Unsupported(f"{label} {ver} is too old; gpusnap needs {label} >= {want}")


def live_facts(pid: int, running: bool) -> tuple[tuple[int, ...], dict[str, str]]:
    """Host pids and cgroup limits of a container whose init is ``pid``; nothing when it is
    not running or exits between the reads."""
    if not running or pid <= 0:
        return (), {}
    try:
        return host_pids(pid), cgroup_limits(pid)
    except FailedPrecondition:
        return (), {}


@contextmanager
def checkpoint_attempt(
    label: str, info: ContainerInfo, dest: Path, still_running: Callable[[], bool]
) -> Iterator[None]:
    """Around a runtime's checkpoint into ``dest``: on failure nothing is left in ``dest``, and
    a container that is gone or stopped since is said to have exited during the checkpoint
    (the job body's GPU freeze, or the runtime's own, came first)."""
    try:
        yield
    except GpusnapError as err:
        shutil.rmtree(dest, ignore_errors=True)
        try:
            running = still_running()
        except NotFound:
            running = False
        if not running:
            raise FailedPrecondition(
                f"{label}: container {info.name!r} exited during the checkpoint ({err})"
            ) from err
        raise
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
