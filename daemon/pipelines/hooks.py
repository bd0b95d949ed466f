"""Per-workload hooks: commands run around a checkpoint and a restore, each with a deadline.

A serving engine may have to be quiet before it is frozen (pause scheduling, drain a load
balancer) and told to go on after::

    [[workload]]
    name = "llm"
    [workload.hooks]            # the same as hooks = { ... } on one line
    pre_checkpoint = ["/usr/local/bin/llm-pause"]
    post_thaw = ["/usr/local/bin/llm-resume"]
    post_restore = { command = ["/usr/local/bin/llm-resume"], timeout_s = 60 }
    timeout_s = 30

- ``pre_checkpoint`` runs before anything is frozen; if it fails (a non-zero exit, or its
  deadline passes and it is killed) the job fails there and the workload is not touched.
- ``post_thaw`` runs once the workload runs on after a checkpoint that ran
  ``pre_checkpoint``: right after the thaw of a leave-running checkpoint (before the upload),
  or after a checkpoint that failed and left the workload running. Not after a kill-mode
  checkpoint that succeeded: the workload is gone.
- ``post_restore`` runs after a restore that brought the workload back (not a cold start).

Each runs as the daemon's user, in ``/``, with stdin from /dev/null, in a session of its own
(killed as a group at its deadline), with ``GPUSNAP_HOOK``, ``GPUSNAP_WORKLOAD``,
``GPUSNAP_JOB_ID``, ``GPUSNAP_PID`` (the tree's root) and ``GPUSNAP_PIDS`` (the tree) in its
environment. Its output goes to the job's hook log, ``<state_dir>/logs/<job id>-hooks.log``,
kept after the job; the job's result lists each hook run (``hooks``: name, exit status,
seconds, log, the last lines of output). A failing post hook is reported there and in the
daemon's log, and does not fail the job: the checkpoint or restore it follows is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusnap.daemon.config.hooks import Hook, WorkloadHooks
from gpusnap.daemon.host import proctree
from gpusnap.errors import FailedPrecondition

if TYPE_CHECKING:
    from gpusnap.daemon.config.file import WorkloadConfig
    from gpusnap.daemon.jobs.executor import JobContext

log = logging.getLogger(__name__)

OUTPUT_TAIL = 2000  # characters of a hook's output kept in the job's result


def run_hook(hook: Hook, log_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``hook`` to its end or its deadline, its output appended to ``log_path``.

    Returns what the job's result records of it; ``exit_status`` None when it was killed at
    its deadline, ``error`` when it could not be started or did not succeed.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    record: dict[str, Any] = {
        "hook": hook.name,
        "command": list(hook.command),
        "log": str(log_path),
    }
    with open(log_path, "ab") as out:
        start_at = out.tell()
        out.write(f"--- {hook.name}: {' '.join(hook.command)}\n".encode())
        out.flush()
        try:
            proc = subprocess.Popen(
                list(hook.command),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd="/",
                env={**os.environ, **env},
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            record |= {
                "exit_status": None,
                "error": f"cannot run {hook.command[0]}: {exc.strerror}",
            }
            return _done(record, started, log_path, start_at)
        try:
            code: int | None = proc.wait(hook.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
            record["error"] = f"did not finish within {hook.timeout_s:g}s and was killed"
        record["exit_status"] = code
        if code:
            record["error"] = f"exited with status {code}"
    return _done(record, started, log_path, start_at)


def _done(record: dict[str, Any], started: float, log_path: Path, start_at: int) -> dict[str, Any]:
    record["seconds"] = round(time.monotonic() - started, 6)
    with open(log_path, "rb") as f:
        f.seek(start_at)
        record["output_tail"] = f.read().decode(errors="replace")[-OUTPUT_TAIL:]
    return record


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class JobHooks:
    """The hooks of one job: runs them, and keeps what they did in the job's result."""

    def __init__(
        self,
        hooks: WorkloadHooks | None,
        *,
        workload: str,
        job_id: str,
        logs: Path,
        record: Any,  # JobContext.result
    ) -> None:
        self._hooks = hooks
        self._env = {"GPUSNAP_WORKLOAD": workload, "GPUSNAP_JOB_ID": job_id}
        self._log = logs / f"{job_id}-hooks.log"
        self._record = record
        self._done: list[dict[str, Any]] = []
        self._paused_root: int | None = None  # pre_checkpoint ran for this tree

    @classmethod
    def for_job(
        cls, config: WorkloadConfig | None, workload: str, ctx: JobContext, logs: Path
    ) -> JobHooks:
        """The hooks of ``workload`` (its config, if any) for the job behind ``ctx``."""
        hooks = config.hooks if config is not None else None
        return cls(hooks, workload=workload, job_id=ctx.job_id, logs=logs, record=ctx.result)

    def _run(self, name: str, pids: Sequence[int], **env: str) -> dict[str, Any] | None:
        hook = self._hooks.get(name) if self._hooks is not None else None
        if hook is None:
            return None
        extra = {"GPUSNAP_HOOK": name, "GPUSNAP_PID": str(pids[0]), **env}
        extra["GPUSNAP_PIDS"] = " ".join(str(p) for p in pids)
        result = run_hook(hook, self._log, self._env | extra)
        self._done.append(result)
        self._record(hooks=list(self._done))
        if "error" in result:
            log.warning(
                "%s hook of %s: %s (%s)",
                name,
                self._env["GPUSNAP_WORKLOAD"],
                result["error"],
                self._log,
            )
        return result

    def pre_checkpoint(self, pids: Sequence[int]) -> None:
        """Before the freeze; a failure fails the job, with nothing frozen."""
        result = self._run("pre_checkpoint", pids)
        if result is None:
            return
        self._paused_root = pids[0]
        if "error" in result:
            # Whatever it did before failing, the workload runs on: let it go on.
            self.post_thaw(pids)
            tail = " ".join(result["output_tail"].split()[-12:])
            raise FailedPrecondition(
                f"pre_checkpoint hook {result['error']}; nothing was frozen, the workload runs "
                f"on (output: {tail or 'none'}; {self._log})"
            )

    def post_thaw(self, pids: Sequence[int]) -> None:
        """Once the workload runs on after ``pre_checkpoint`` ran; once per job."""
        if self._paused_root is None:
            return
        self._paused_root = None
        self._run("post_thaw", pids)

    def after_checkpoint(self, pids: Sequence[int]) -> None:
        """When the checkpoint ends, however: ``post_thaw`` if the workload still runs here."""
        if self._paused_root is not None and proctree.exists(self._paused_root):
            self.post_thaw(pids)

    def post_restore(self, pids: Sequence[int], checkpoint_id: str) -> None:
        self._run("post_restore", pids, GPUSNAP_CHECKPOINT_ID=checkpoint_id)
