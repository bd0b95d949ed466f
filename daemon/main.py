"""``gpusnapd --config FILE``: the node daemon, in the foreground (systemd runs exactly this).

Start order: config (an error is one line and exit 2; key files must load) -> the state
dir's lock (another daemon holds it: one line, exit 1, nothing touched) -> CRIU check (missing
or too old: one actionable line, exit 1) -> recovery of a dead daemon's jobs
(``pipelines/recovery.py``: a kill-mode dump's images restored, the rest of staging removed), store
(unreachable: a warning; jobs fail with Unavailable until it is back) -> reclaim (watchers,
policy, standby: ``daemon/reclaim/``) -> the store check's schedule (``daemon/node/storecheck.py``)
-> the gRPC socket -> ``READY=1`` and the watchdog.
SIGTERM/SIGINT: ``STOPPING=1``, the shutdown hooks (a reclaim checkpoint may run there),
running jobs get time to finish while systemd is asked for more (``EXTEND_TIMEOUT_USEC``),
then exit 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from gpusnap import __version__
from gpusnap.daemon.api import TcpListenerConfig, start_server, stop_server
from gpusnap.daemon.config.file import DEFAULT_CONFIG_PATH, Config, load_config
from gpusnap.daemon.host.criu import Criu, systemd_running
from gpusnap.daemon.infra import sdnotify
from gpusnap.daemon.infra.metrics import start_metrics_server
from gpusnap.daemon.infra.statedir import StateDirLock
from gpusnap.daemon.reclaim.config import WorkloadPolicy
from gpusnap.daemon.reclaim.runtime import ReclaimRuntime
from gpusnap.daemon.service import DaemonService
from gpusnap.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    GpusnapError,
    InvalidArgument,
    exit_code_for,
)
from gpusnap.storage.redact import RedactSecrets

log = logging.getLogger("gpusnap.daemon")

LOOP_TICK = 1.0  # seconds between main-loop heartbeats
STOP_JOB_GRACE = 120.0  # seconds running jobs get at stop before they are left interrupted
EXTEND_STEP_USEC = 30_000_000


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactSecrets())  # botocore's debug lines carry credentials
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        # journald adds the time; the level and logger are what a reader needs.
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"gpusnapd: error: {' '.join(message.split())}\n")
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpusnapd", description="gpusnap node daemon")
    p.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG_PATH,
        metavar="FILE",
        help=f"TOML config (default {DEFAULT_CONFIG_PATH})",
    )
    p.add_argument("--version", action="version", version=f"gpusnapd {__version__}")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    p.add_argument(
        "--check-config", action="store_true", help="check the config and exit (0: fine)"
    )
    return p


def _start_reclaim(service: DaemonService, config: Config) -> None:
    """Watchers, policy, logind and the standby loop (docs/triggers.md), from the typed config."""
    runtime = ReclaimRuntime(
        service,
        config.triggers,
        config.migration,
        [w.policy or WorkloadPolicy(w.name) for w in config.workloads],
        daemon_node_id=config.daemon.node_id,
        store_verifies=config.store.verify,
    )
    runtime.start()
    service.attach_reclaim(runtime)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
    except InvalidArgument as err:
        return _fail(str(err), EXIT_USAGE)
    if args.check_config:
        sys.stdout.write(f"{args.config}: ok\n")
        return EXIT_OK

    # Before anything else touches the state dir: a second daemon on it stops here, having
    # changed nothing (its recovery would delete the running daemon's staging images).
    try:
        state_lock = StateDirLock.acquire(config.daemon.state_dir, config.daemon.staging_dir)
    except GpusnapError as err:
        return _fail(f"cannot start: {err}", exit_code_for(err))

    criu = Criu(log_level=config.daemon.criu_log_level)
    try:
        criu.check()
    except GpusnapError as err:
        return _fail(f"CRIU is required: {err}", EXIT_FAILURE)

    # The service's start settles what a dead daemon left (a kill-mode dump's images are
    # restored there: daemon/pipelines/recovery.py), which may outlast systemd's start timeout.
    started = threading.Event()
    threading.Thread(target=_extend_until, args=(started,), daemon=True).start()
    try:
        service = DaemonService(config, criu=criu, state_lock=state_lock)
    except GpusnapError as err:
        return _fail(f"cannot start: {err}", exit_code_for(err))
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        return _fail(f"cannot start: {where}{err.strerror or err}", EXIT_FAILURE)
    finally:
        started.set()

    if not systemd_running():
        # Where PID 1 is not systemd it may reap nothing: adopt the orphans of restored trees
        # (whose roots are our children, see restore.run_restore) and reap them ourselves.
        _set_child_subreaper()
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        _start_reclaim(service, config)
        service.store_check.start()
        tcp = config.daemon.tcp
        server = start_server(
            service,
            socket_path=config.daemon.socket,
            socket_group=config.daemon.socket_group,
            tcp=(
                TcpListenerConfig(tcp.listen, tcp.cert_file, tcp.key_file, tcp.client_ca_file)
                if tcp is not None
                else None
            ),
        )
        metrics = start_metrics_server(config.metrics.listen) if config.metrics.listen else None
    except GpusnapError as err:
        service.close(timeout=0)
        return _fail(f"cannot start: {err}", EXIT_FAILURE)

    health = sdnotify.LoopHealth(max_age=10 * LOOP_TICK)
    watchdog = sdnotify.Watchdog(sdnotify.Notifier(), health)
    watchdog.start()
    sdnotify.ready(status=_status_line(service))
    log.info(
        "gpusnapd %s ready: socket %s, store %s, %d workload(s)",
        __version__,
        config.daemon.socket,
        config.store.url,
        len(config.workloads),
    )
    last_status = ""
    while not stop.wait(LOOP_TICK):
        health.beat()
        line = _status_line(service)
        if line != last_status:
            sdnotify.status(line)
            last_status = line
        service.executor.prune()

    sdnotify.stopping(status="stopping: finishing jobs")
    closed = threading.Event()
    extender = threading.Thread(target=_extend_until, args=(closed,), daemon=True)
    extender.start()
    try:
        service.close(timeout=STOP_JOB_GRACE)
    finally:
        closed.set()
        stop_server(server, config.daemon.socket, grace=2.0)
        if metrics is not None:
            metrics.close()
        watchdog.stop()
    log.info("gpusnapd stopped")
    return EXIT_OK


def _set_child_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(36, 1, 0, 0, 0) != 0  # PR_SET_CHILD_SUBREAPER
    except OSError as exc:
        log.warning("cannot become a child subreaper (%s); orphans go to PID 1", exc)
        return
    if failed:
        err = os.strerror(ctypes.get_errno())
        log.warning("cannot become a child subreaper (%s); orphans go to PID 1", err)


def _status_line(service: DaemonService) -> str:
    running = service.executor.running()
    return f"serving; {running} job(s) running" if running else "serving; idle"


def _extend_until(done: threading.Event) -> None:
    """Keep asking systemd for more stop time while the stop work (hooks, jobs) runs."""
    while not done.is_set():
        sdnotify.extend_timeout(EXTEND_STEP_USEC)
        done.wait(EXTEND_STEP_USEC / 2e6)


if __name__ == "__main__":
    sys.exit(main())
