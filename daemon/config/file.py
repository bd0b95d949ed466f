"""gpusnapd's configuration: one TOML file, parsed and checked completely before anything starts.

Every section and key is listed here; an unknown key or a bad value is an ``InvalidArgument``
whose one-line message names the key (and suggests the closest known one), and the daemon
refuses to start with it. ``docs/config.md`` documents the same keys.

The ``[triggers]`` and ``[migration]`` tables and each workload's trigger policy keys belong to
reclaim: ``gpusnap.daemon.reclaim.config`` parses them into its typed, frozen tables.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gpusnap.daemon.config.containers import ContainersSection, parse_containers
from gpusnap.daemon.config.hooks import WorkloadHooks, parse_hooks
from gpusnap.daemon.config.table import Table
from gpusnap.daemon.containers.runtimes import RUNTIMES
from gpusnap.daemon.host.coldstart import StartSpec
from gpusnap.daemon.reclaim.config import (
    POLICY_KEYS,
    MigrationConfig,
    TriggersConfig,
    WorkloadPolicy,
    parse_migration,
    parse_triggers,
    parse_workload_policy,
)
from gpusnap.errors import GpusnapError, InvalidArgument
from gpusnap.storage.backend import (
    MAX_PART_BYTES,
    MAX_WORKERS,
    MIN_PART_BYTES,
    BackendOptions,
    registered_schemes,
)
from gpusnap.storage.keys import load_encryption_key, load_signing_key, load_trusted_keys

DEFAULT_CONFIG_PATH = Path("/etc/gpusnap/gpusnapd.toml")
DEFAULT_SOCKET = "/run/gpusnap/gpusnapd.sock"
DEFAULT_STATE_DIR = "/var/lib/gpusnap"
DEFAULT_STORE_URL = "file:///var/lib/gpusnap/store"
DEFAULT_CHECK_INTERVAL = 6 * 3600.0  # [store] check_interval: seconds between store checks

_T = TypeVar("_T")

_POLICY_KEYS = tuple(sorted(POLICY_KEYS))
# sun_path is 108 bytes with its terminating NUL: a longer socket path cannot be bound.
MAX_SOCKET_PATH_BYTES = 107
_WORKLOAD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class TcpListener:
    """The optional remote listener; always mutual TLS."""

    listen: str  # host:port
    cert_file: Path
    key_file: Path
    client_ca_file: Path
    # [daemon.tcp.clients]: certificate name (subject CN or a subject alternative name) ->
    # "admin" or a local user name whose rights the caller gets. None: every certificate the
    # client CA signs is an administrator; given, an unlisted certificate may do nothing.
    clients: Mapping[str, str] | None = None


@dataclass(frozen=True)
class DaemonSection:
    socket: Path = Path(DEFAULT_SOCKET)
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    socket_group: str = "gpusnap"
    # Members of this group may do everything root may through the API; None: root only.
    admin_group: str | None = None
    node_id: str | None = None  # default: the host name
    max_jobs: int = 4  # jobs running at once; more wait in QUEUED
    tcp: TcpListener | None = None
    # Where images are written between CRIU and the store (default <state_dir>/staging): a
    # tmpfs or local NVMe here keeps dump and restore off slower disks.
    staging_dir: Path | None = None
    criu_log_level: int = 4  # criu -v0..-v4 for its per-job log (kept only on failure)
    # Upload page images while CRIU writes them (a first checkpoint: daemon/host/pagestream.py).
    upload_during_dump: bool = True


@dataclass(frozen=True)
class StoreSection:
    url: str = DEFAULT_STORE_URL
    key_file: Path | None = None
    encryption_key_file: Path | None = None
    cache_dir: Path | None = None
    workers: int | None = None
    compress: bool | None = None  # None: the store decides
    verify: bool = True
    options: BackendOptions = field(default_factory=BackendOptions)
    # Public keys (files, or directories of *.pub) whose signatures this node accepts besides
    # its own key's: other nodes', and retired keys whose checkpoints must still restore.
    trusted_keys: tuple[Path, ...] = ()
    # Seconds between background checks that every chunk the store's checkpoints name is
    # there (daemon/node/storecheck.py); 0: off.
    check_interval: float = DEFAULT_CHECK_INTERVAL


@dataclass(frozen=True)
class EngineSpec:
    """``[[workload]] engine = { name, version }``: the serving engine the compatibility gate
    compares a checkpoint's against."""

    name: str
    version: str


@dataclass(frozen=True)
class ModelSpec:
    """``[[workload]] model = { name, revision }``: the weights the workload serves."""

    name: str
    revision: str


@dataclass(frozen=True)
class WorkloadConfig:
    name: str
    pid_file: Path | None = None
    systemd_unit: str | None = None
    match: str | None = None  # a regular expression over the command line
    engine: EngineSpec | None = None  # declared; None with engine_probed=False: not checked
    engine_probed: bool = False  # engine = "probed": read from the process at checkpoint time
    model: ModelSpec | None = None
    # The directory of its config and weights files, digested into the stamp (model_digest.py);
    # None: found on the process's command line, if there.
    model_dir: Path | None = None
    start: StartSpec | None = None
    # The trigger policy keys (on_notice, checkpoint_interval, checkpoint_on_rebalance), as
    # gpusnap.daemon.reclaim.config reads them; None: the defaults.
    policy: WorkloadPolicy | None = None
    hooks: WorkloadHooks | None = None  # commands around a checkpoint and a restore
    container: str | None = None  # a container workload: its name or id (docs/containers.md)
    runtime: str | None = None  # its runtime; None: detected ([containers] detect)
    # The user the workload runs as: its pid_file may be owned by root or this user, and
    # match finds only this user's processes.
    user: str | None = None
    # Callers besides root and the admin group who may checkpoint and restore it.
    allow_users: tuple[str, ...] = ()
    allow_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuSection:
    driver: str = "auto"  # auto | cuda | none
    lock_timeout_s: float = 10.0
    call_timeout_s: float = 120.0
    copy_rate_gbps: float = 1.0  # checkpoint and restore deadlines: + device memory at this rate
    nvidia_version_file: Path = Path("/proc/driver/nvidia/version")


@dataclass(frozen=True)
class MetricsSection:
    listen: str | None = None  # host:port; None = off


@dataclass(frozen=True)
class CacheSection:
    """The node's chunk cache (``storage/cache``): every pull on the node reads it first, the
    daemon's own checkpoints seed it, a standby prefetches into it."""

    enabled: bool = True
    dir: Path | None = None  # default: <state_dir>/cache
    max_bytes: int | None = None  # default: the budget recorded there, else 1/4 of its disk
    seed: bool = True  # the daemon's own checkpoints leave their chunks in it

    def directory(self, state_dir: Path) -> Path:
        return self.dir or (state_dir / "cache")


@dataclass(frozen=True)
class Config:
    path: Path | None
    daemon: DaemonSection
    store: StoreSection
    workloads: tuple[WorkloadConfig, ...]
    gpu: GpuSection
    metrics: MetricsSection
    triggers: TriggersConfig
    migration: MigrationConfig
    containers: ContainersSection = field(default_factory=ContainersSection)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)
    cache: CacheSection = field(default_factory=CacheSection)

    def workload(self, name: str) -> WorkloadConfig | None:
        for w in self.workloads:
            if w.name == name:
                return w
        return None


def load_config(path: Path | str = DEFAULT_CONFIG_PATH) -> Config:
    """Read and check ``path``, and the key files it names (they must exist and load).

    Any problem is ``InvalidArgument`` with a one-line message naming the key.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidArgument(f"config: {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"config: {p}: cannot read: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"config: {p}: not valid TOML: {exc}") from exc
    except RecursionError as exc:  # tomllib recurses per level of nesting
        raise InvalidArgument(f"config: {p}: nested too deeply to be a gpusnapd config") from exc
    config = parse_config(data, path=p)
    check_key_files(config.store)
    return config


def check_key_files(store: StoreSection) -> None:
    """Load the store's key files as the store will: a config whose keys cannot be read, or are
    not keys of the right kind and size, could never checkpoint or restore, so it is refused
    at load time (``InvalidArgument`` naming the key) rather than failing every job later."""
    checks = (
        ("key_file", store.key_file, load_signing_key),
        ("encryption_key_file", store.encryption_key_file, load_encryption_key),
    )
    for key, path, loader in checks:
        if path is None:
            continue
        try:
            loader(path)
        except GpusnapError as err:
            raise InvalidArgument(f"config: [store] {key}: {err}") from err
    try:
        load_trusted_keys(store.trusted_keys)
    except GpusnapError as err:
        raise InvalidArgument(f"config: [store] trusted_keys: {err}") from err


def parse_config(data: Mapping[str, Any], *, path: Path | None = None) -> Config:
    top = Table(data, "config")
    # Keyword arguments are evaluated in order: the sections are read, and their errors
    # raised, in this order.
    config = Config(
        path=path,
        daemon=_parse_daemon(top.table("daemon")),
        store=_parse_store(top.table("store")),
        workloads=_parse_workloads(top.array_of_tables("workload")),
        gpu=_parse_gpu(top.table("gpu")),
        metrics=_parse_metrics(top.table("metrics")),
        cache=parse_cache(top.table("cache")),
        triggers=parse_triggers(top.raw_table("triggers")),
        migration=parse_migration(top.raw_table("migration")),
        containers=parse_containers(top.table("containers")),
        raw=dict(data),
    )
    top.done()
    _check_store_keys(config.store)
    return config


# --- sections ---------------------------------------------------------------------------------


def _parse_daemon(t: Table) -> DaemonSection:
    d = DaemonSection()
    tcp_t = t.table("tcp", optional=True)
    tcp: TcpListener | None = None
    if tcp_t is not None:
        tcp = TcpListener(
            listen=tcp_t.host_port("listen", required=True) or "",
            cert_file=tcp_t.path("cert_file", required=True) or Path(),
            key_file=tcp_t.path("key_file", required=True) or Path(),
            client_ca_file=tcp_t.path("client_ca_file", required=True) or Path(),
            clients=tcp_t.string_map("clients"),
        )
        tcp_t.done()
    section = DaemonSection(
        socket=t.path("socket") or d.socket,
        state_dir=t.path("state_dir") or d.state_dir,
        socket_group=t.string("socket_group") or d.socket_group,
        admin_group=t.string("admin_group"),
        node_id=t.string("node_id"),
        max_jobs=t.integer("max_jobs", minimum=1) or d.max_jobs,
        tcp=tcp,
        staging_dir=t.path("staging_dir"),
        criu_log_level=_or(t.integer("criu_log_level", minimum=0), d.criu_log_level),
        upload_during_dump=_or(t.boolean("upload_during_dump"), d.upload_during_dump),
    )
    if section.criu_log_level > 4:
        raise t.bad("criu_log_level", "must be 0 to 4 (criu -v0 .. -v4)")
    length = len(os.fsencode(str(section.socket)))
    if length > MAX_SOCKET_PATH_BYTES:
        raise t.bad(
            "socket", f"path too long for a unix socket ({length} > {MAX_SOCKET_PATH_BYTES} bytes)"
        )
    t.done()
    return section


def _parse_store(t: Table) -> StoreSection:
    url = t.string("url") or DEFAULT_STORE_URL
    _check_store_url(url)
    o = BackendOptions()
    addressing = t.choice("addressing_style", ("path", "virtual", "auto"))
    options = BackendOptions(
        endpoint_url=t.string("endpoint_url"),
        region=t.string("region"),
        addressing_style=addressing,
        profile=t.string("profile"),
        sse=t.choice("sse", ("AES256", "aws:kms")),
        sse_kms_key_id=t.string("sse_kms_key_id"),
        multipart_threshold=t.integer("multipart_threshold", minimum=1) or o.multipart_threshold,
        multipart_chunksize=t.integer(
            "multipart_chunksize", minimum=MIN_PART_BYTES, maximum=MAX_PART_BYTES
        )
        or o.multipart_chunksize,
        max_pool_connections=t.integer("max_pool_connections", minimum=1, maximum=MAX_WORKERS)
        or o.max_pool_connections,
        connect_timeout=t.number("connect_timeout", minimum=0.001) or o.connect_timeout,
        read_timeout=t.number("read_timeout", minimum=0.001) or o.read_timeout,
        retry_attempts=_or(t.integer("retry_attempts", minimum=1), o.retry_attempts),
        retry_base_delay=_or(t.number("retry_base_delay", minimum=0.0), o.retry_base_delay),
        retry_max_delay=_or(t.number("retry_max_delay", minimum=0.0), o.retry_max_delay),
        retry_deadline=t.number("retry_deadline", minimum=0.001),
    )
    section = StoreSection(
        url=url,
        key_file=t.path("key_file"),
        encryption_key_file=t.path("encryption_key_file"),
        cache_dir=t.path("cache_dir"),
        workers=t.integer("workers", minimum=1, maximum=MAX_WORKERS),
        compress=t.boolean("compress"),
        verify=_or(t.boolean("verify"), True),
        options=options,
        trusted_keys=tuple(Path(p) for p in t.string_list("trusted_keys") or ()),
        check_interval=_check_interval(t),
    )
    t.done()
    return section


def _check_interval(t: Table) -> float:
    seconds = t.number("check_interval", minimum=0.0)
    if seconds is None:
        return DEFAULT_CHECK_INTERVAL
    if not math.isfinite(seconds):  # TOML has inf and nan; neither is a schedule
        raise t.bad("check_interval", "must be a number of seconds (0: off)")
    return seconds


def _check_store_keys(store: StoreSection) -> None:
    # After the whole file parsed: a misspelt key is reported as that, not as a missing one.
    if store.key_file is None and store.verify:
        raise InvalidArgument(
            "config: [store] missing key 'key_file': manifests can be neither signed nor "
            "authenticated without it (make one with `gpusnap store keygen`; only "
            "`verify = false` runs without, and then this node will not restore)"
        )


def _check_store_url(url: str) -> None:
    """What can be told of a store URL without reaching the store: a registered scheme, and
    for ``file://`` an absolute local path. Reaching it is left to the start (a warning)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        raise InvalidArgument(f"config: [store] url: {url!r} is not a URL (file:///… or s3://…)")
    known = registered_schemes()
    if scheme.lower() not in known:
        raise InvalidArgument(
            f"config: [store] url: unknown scheme {scheme!r} in {url!r}; supported: "
            f"{', '.join(f'{k}://' for k in known)}"
        )
    if scheme.lower() == "file":
        host, _, path = rest.partition("/")
        if host not in ("", "localhost") or not path:
            raise InvalidArgument(
                f"config: [store] url: {url!r} must name an absolute local path (file:///path)"
            )
    elif scheme.lower() == "s3" and not rest.split("/", 1)[0]:
        raise InvalidArgument(f"config: [store] url: {url!r} names no bucket (s3://bucket/prefix)")


def _parse_workloads(tables: list[Table]) -> tuple[WorkloadConfig, ...]:
    out: list[WorkloadConfig] = []
    seen: set[str] = set()
    for t in tables:
        name = t.string("name", required=True) or ""
        if not _WORKLOAD_NAME.fullmatch(name):
            raise InvalidArgument(
                f"{t.where}: key 'name': {name!r} is not a workload name "
                "(letters, digits, '.', '_', '-'; at most 128)"
            )
        t.where = f"{t.where} {name!r}"
        if name in seen:
            raise InvalidArgument(f"{t.where}: the name is used by another [[workload]]")
        seen.add(name)
        pid_file = t.path("pid_file")
        unit = t.string("systemd_unit")
        match = t.string("match")
        if match is not None:
            try:
                re.compile(match)
            except re.error as exc:
                raise InvalidArgument(
                    f"{t.where}: key 'match': not a regular expression: {exc}"
                ) from None
        user = t.string("user")
        if user is not None and not user:
            raise t.bad("user", "must name a user")
        container = t.string("container")
        runtime = t.choice("runtime", RUNTIMES)
        if runtime is not None and container is None:
            raise t.bad("runtime", "goes with 'container' (the runtime that runs it)")
        given = (
            ("pid_file", pid_file),
            ("systemd_unit", unit),
            ("match", match),
            ("container", container),
        )
        finders = [k for k, v in given if v is not None]
        if len(finders) > 1:
            raise InvalidArgument(
                f"{t.where}: give one of 'pid_file', 'systemd_unit', 'match', 'container'"
                f" (got {', '.join(finders)})"
            )
        engine: EngineSpec | None = None
        probed = False
        raw_engine = t.get("engine")
        if raw_engine == "probed":
            probed = True
        elif raw_engine is not None:
            if not isinstance(raw_engine, dict):
                raise InvalidArgument(
                    f"{t.where}: key 'engine': must be \"probed\" or {{ name, version }}"
                    f" (got {raw_engine!r})"
                )
            et = t.table("engine")
            engine = EngineSpec(
                name=et.string("name", required=True) or "",
                version=et.string("version", required=True) or "",
            )
            et.done()
        model: ModelSpec | None = None
        if t.get("model") is not None:
            mt = t.table("model")
            model = ModelSpec(
                name=mt.string("name", required=True) or "",
                revision=mt.string("revision", required=True) or "",
            )
            mt.done()
        start: StartSpec | None = None
        if t.get("start") is not None:
            st = t.table("start")
            command = st.string_list("command", required=True) or []
            if not command:
                raise InvalidArgument(f"{st.where}: key 'command': must not be empty")
            start = StartSpec(
                command=tuple(command),
                cwd=st.string("cwd"),
                env=st.string_map("env") or {},
                user=st.string("user"),
                checkpoint_ready=st.boolean("checkpoint_ready") is not False,
            )
            st.done()
        policy_keys = {k: t.get(k) for k in _POLICY_KEYS if t.data.get(k) is not None}
        policy = parse_workload_policy(name, policy_keys) if policy_keys else None
        hooks = parse_hooks(t)
        out.append(
            WorkloadConfig(
                name=name,
                pid_file=pid_file,
                systemd_unit=unit,
                match=match,
                engine=engine,
                engine_probed=probed,
                model=model,
                model_dir=t.path("model_dir"),
                start=start,
                policy=policy,
                hooks=hooks,
                container=container,
                runtime=runtime,
                user=user,
                allow_users=tuple(t.string_list("allow_users") or ()),
                allow_groups=tuple(t.string_list("allow_groups") or ()),
            )
        )
        t.done()
    return tuple(out)


def _parse_gpu(t: Table) -> GpuSection:
    g = GpuSection()
    section = GpuSection(
        driver=t.choice("driver", ("auto", "cuda", "none")) or g.driver,
        lock_timeout_s=t.number("lock_timeout_s", minimum=0.001) or g.lock_timeout_s,
        call_timeout_s=t.number("call_timeout_s", minimum=0.001) or g.call_timeout_s,
        copy_rate_gbps=t.number("copy_rate_gbps", minimum=0.001) or g.copy_rate_gbps,
        nvidia_version_file=t.path("nvidia_version_file") or g.nvidia_version_file,
    )
    t.done()
    return section


def _parse_metrics(t: Table) -> MetricsSection:
    section = MetricsSection(listen=t.host_port("listen"))
    t.done()
    return section


def parse_cache(t: Table) -> CacheSection:
    """``[cache]`` -> ``CacheSection``; an unknown key or a wrong type is ``InvalidArgument``."""
    d = CacheSection()
    # Read in the table's documented order, so that of two bad keys the first is named.
    enabled = t.boolean("enabled")
    directory = t.path("dir")
    max_bytes = t.integer("max_bytes", minimum=1)
    seed = t.boolean("seed")
    section = CacheSection(
        enabled=d.enabled if enabled is None else enabled,
        dir=directory,
        max_bytes=max_bytes,
        seed=d.seed if seed is None else seed,
    )
    t.done()
    return section


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value
