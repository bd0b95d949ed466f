"""What ``gpusnap status`` and ``gpusnap workloads`` show: the daemon, this node, each workload.

Read-only answers built from the node (``node.Node``) and the job executor; every key is a
contract of the CLI's ``--json`` output (``docs/api.md``). A store that cannot be asked is
reported in the answer (``store_error``, ``reachable: false``), never raised.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gpusnap
from gpusnap.daemon.config.file import WorkloadConfig
from gpusnap.daemon.host.target import workload_root
from gpusnap.daemon.jobs.job import Job
from gpusnap.daemon.node.node import Node
from gpusnap.errors import GpusnapError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DaemonFacts:
    """What the status says of the daemon process itself, besides the node."""

    started_at: float
    jobs_running: int
    interrupted_at_start: list[str]
    triggers: bool  # a cloud watcher runs (a notice can come)
    trigger_provider: str = "none"  # which: "aws", "gcp", "azure" (comma-separated), "none"
    store_check: dict[str, Any] | None = None  # daemon/node/storecheck.py:StoreChecker.status


def last_checkpoints(node: Node) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Each configured workload's latest committed checkpoint in the store: ``{name:
    {last_checkpoint_id, last_checkpoint_at, last_checkpoint_age_seconds}}`` (None when it
    has none), and the store's error when it could not be asked."""
    names = [w.name for w in node.config.workloads]
    empty: dict[str, Any] = {
        "last_checkpoint_id": None,
        "last_checkpoint_at": None,
        "last_checkpoint_age_seconds": None,
    }
    out = {n: dict(empty) for n in names}
    if not names:
        return out, None
    now = time.time()
    try:
        store = node.store.get()
        for name in names:
            summary = store.latest(name)
            if summary is not None:
                out[name].update(
                    last_checkpoint_id=summary.checkpoint_id,
                    last_checkpoint_at=summary.created_at,
                    last_checkpoint_age_seconds=round(max(0.0, now - summary.created_at), 3),
                )
    except GpusnapError as err:
        return out, str(err)
    return out, None


def workloads(node: Node, active: Callable[[str], Job | None]) -> list[dict[str, Any]]:
    """The configured workloads: running or not, how each is found, its identity, its active
    checkpoint job (``active``) and its latest checkpoint."""
    out: list[dict[str, Any]] = []
    last, store_error = last_checkpoints(node)
    for w in node.config.workloads:
        pid: int | None
        try:
            pid = _container_pid(node, w) if w.container else workload_root(w)
        except GpusnapError:
            pid = None
        job = active(w.name)
        out.append(
            {
                "name": w.name,
                "running": pid is not None,
                "pid": pid,
                "finder": _finder(w),
                "engine": (
                    "probed"
                    if w.engine_probed
                    else f"{w.engine.name} {w.engine.version}"
                    if w.engine
                    else None
                ),
                "model": f"{w.model.name}@{w.model.revision}" if w.model else None,
                "active_job": job.id if job else None,
                **last[w.name],
                "store_error": store_error,
            }
        )
    return out


def _container_pid(node: Node, w: WorkloadConfig) -> int | None:
    """A container workload's init, by its host pid, while it runs."""
    _, info = node.containers.find(w.container or "", w.runtime)
    return info.pids[0] if info.running else None


def _finder(w: WorkloadConfig) -> str:
    if w.container:
        return f"container {w.container}" + (f" ({w.runtime})" if w.runtime else "")
    if w.pid_file:
        return f"pid_file {w.pid_file}"
    if w.systemd_unit:
        return f"systemd_unit {w.systemd_unit}"
    if w.match:
        return f"match {w.match}"
    return "none"


def daemon_status(node: Node, daemon: DaemonFacts) -> dict[str, Any]:
    """The whole ``gpusnap status`` answer."""
    store_ok = True
    store_error: str | None = None
    try:
        node.store.get()
    except GpusnapError as err:
        store_ok, store_error = False, str(err)
    try:
        host: dict[str, Any] = node.host.get()
    except GpusnapError as err:
        host = {"error": str(err)}
    gpu = node.gpu.capabilities()
    last, list_error = last_checkpoints(node)
    if store_ok and list_error is not None:
        store_ok, store_error = False, list_error
    config = node.config
    return {
        "version": gpusnap.__version__,
        "node_id": host.get("node_id"),
        "pid": os.getpid(),
        "uptime_seconds": round(time.time() - daemon.started_at, 3),
        "socket": str(config.daemon.socket),
        "state_dir": str(node.dirs.state),
        "staging_dir": str(node.dirs.staging),
        "store": {"url": config.store.url, "reachable": store_ok, "error": store_error},
        "host": host,
        "gpu": gpu,
        "capabilities": {
            "criu": _criu_line(node),
            "gpu": str(gpu.get("message") or ("present" if gpu.get("driver_present") else "none")),
            "store": "reachable" if store_ok else f"unreachable: {store_error}",
            "containers": _containers_line(node),
            "cache": _cache_line(node),
        },
        "jobs_running": daemon.jobs_running,
        "workloads": [
            {"name": name, **info, "warm": _warmth(node, info) if store_ok else None}
            for name, info in last.items()
        ],
        "interrupted_at_start": daemon.interrupted_at_start,
        "triggers": daemon.triggers,
        "store_check": daemon.store_check,
        "trigger_provider": daemon.trigger_provider,
        "criu": criu_status(node),
    }


def _containers_line(node: Node) -> str:
    """Each runtime of ``[containers] detect`` with its version, or why it cannot be used."""
    out: list[str] = []
    for name in node.containers.detect:
        try:
            out.append(f"{name} {node.containers.get(name).version()}")
        except GpusnapError as err:  # its message names the runtime
            out.append(str(err) if str(err).startswith(name) else f"{name}: {err}")
    return "; ".join(out)


def _cache_line(node: Node) -> str:
    """The node's chunk cache in one line: where, or why there is none."""
    if not node.config.cache.enabled:
        return "off ([cache] enabled = false)"
    cache = node.store.cache
    if cache is not None:
        return f"{cache.dir}, budget {cache.max_bytes} bytes"
    return f"not used: {node.store.cache_error or 'the store is not open yet'}"


def _warmth(node: Node, last: dict[str, Any]) -> dict[str, Any] | None:
    """How much of the workload's latest checkpoint is in this node's chunk cache."""
    checkpoint_id = last.get("last_checkpoint_id")
    if not isinstance(checkpoint_id, str):
        return None
    try:
        return node.store.warmth(checkpoint_id)
    except GpusnapError as err:
        log.warning("cannot tell how much of %s is cached here: %s", checkpoint_id, err)
        return None


def _criu_line(node: Node) -> str:
    try:
        major, minor, patch = node.criu.version()
        tcp = "dumps TCP sockets" if node.criu.tcp_support().ok else "cannot dump TCP sockets"
        return f"criu {major}.{minor}.{patch} at {node.criu.path} ({tcp} here)"
    except GpusnapError as err:
        return f"unavailable: {err}"


def criu_status(node: Node) -> dict[str, Any]:
    """The CRIU the daemon dumps with: path, version, and whether it can dump TCP sockets on
    this kernel (``Criu.tcp_support``: the version and one getsockopt, criu#2705)."""
    out: dict[str, Any] = {"path": "", "version": "", "error": None}
    out.update(tcp_dump=False, tcp_dump_reason="", kernel=os.uname().release)
    try:
        out["path"] = str(node.criu.path)
        out["version"] = ".".join(str(n) for n in node.criu.version())
        tcp = node.criu.tcp_support()
    except GpusnapError as err:
        out["error"] = str(err)
        out["tcp_dump_reason"] = f"no usable criu: {err}"
        return out
    out.update(tcp_dump=tcp.ok, tcp_dump_reason=tcp.why)
    return out
