"""The transient scopes gpusnapd restores trees into where systemd is PID 1.

A restore runs CRIU in ``gpusnap-<workload>-<job>.scope`` (``systemd-run --scope``), outside
gpusnapd's cgroup, so the tree outlives daemon restarts; its description, what ``systemctl
status`` and ``list-units`` show, says what it is (systemd's default would be the whole criu
command line). A workload found by ``systemd_unit`` leaves its unit when it is restored:
``restored_root`` finds it in the newest running scope named for it, so ``--workload`` goes on
working after a restore.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from gpusnap.daemon.host import proctree

CGROUP_ROOT = Path("/sys/fs/cgroup")
# What ``jobs.job.new_job_id`` makes (host/ may not import jobs/): the tail of a scope's name.
_JOB_ID = r"\d{8}T\d{6}-[0-9a-f]{6}"


def unit_name(workload: str, job_id: str) -> str:
    """The scope a job restores ``workload`` into."""
    return f"gpusnap-{workload}-{job_id}.scope"


def description(workload: str, source: str) -> str:
    """One short line for ``systemctl``: ``gpusnap: llm restored from <checkpoint>``."""
    return f"gpusnap: {workload} restored from {source}"


def restored_root(workload: str) -> int | None:
    """The root pid of ``workload``'s tree in the newest running scope a restore made for it;
    None where systemd is not PID 1 or no such scope runs."""
    if not Path("/run/systemd/system").is_dir() or shutil.which("systemctl") is None:
        return None
    pattern = re.compile(rf"gpusnap-{re.escape(workload)}-({_JOB_ID})\.scope")
    listed = _systemctl(
        "list-units", "--type=scope", "--state=running", "--plain", "--no-legend", "gpusnap-*"
    )
    names = [
        m for line in listed.splitlines() if line and (m := pattern.fullmatch(line.split()[0]))
    ]
    # Job ids sort by time: the newest restore first (an older scope may linger briefly).
    for match in sorted(names, key=lambda m: m[1], reverse=True):
        cgroup = _systemctl("show", "-p", "ControlGroup", "--value", match[0]).strip()
        root = _root_of(CGROUP_ROOT / cgroup.lstrip("/")) if cgroup else None
        if root is not None:
            return root
    return None


def _root_of(cgroup: Path) -> int | None:
    try:
        pids = {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return None
    roots = [p for p in pids if proctree.exists(p) and proctree.ppid(p) not in pids]
    return min(roots) if roots else None


def _systemctl(*args: str) -> str:
    try:
        proc = subprocess.run(
            ["systemctl", *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""
