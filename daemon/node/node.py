"""This node, as the job bodies see it: ``Node`` holds the parts a checkpoint or restore uses.

The service builds one ``Node`` at start and hands it to every job body (``pipelines/``); a
body never sees the service, so nothing calls back into it.
A ``Node`` holds: the config, CRIU, GPU support, the store (opened lazily), the state
directories, this host's facts, the reaper that adopts what a job restores or starts, and the
container runtimes. It also answers the compatibility gate for a manifest (host, GPU and
container rules together).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

from gpusnap.daemon.config.file import Config
from gpusnap.daemon.containers import RuntimeSet
from gpusnap.daemon.gate.compat import NodeFacts, check_compat
from gpusnap.daemon.gate.container_stamp import container_gate
from gpusnap.daemon.gate.model_digest import cache_in
from gpusnap.daemon.gate.stamp import gpusnap_stamp, host_stamp
from gpusnap.daemon.gate.verdict import Reason
from gpusnap.daemon.gpu.adapter import GpuAdapter
from gpusnap.daemon.host.criu import Criu
from gpusnap.daemon.host.reaper import Reaper
from gpusnap.daemon.infra.statedir import StateDirs
from gpusnap.errors import FailedPrecondition, GpusnapError
from gpusnap.storage import CheckpointStore, ChunkCache, Manifest, open_store

log = logging.getLogger(__name__)


class StoreHandle:
    """Opens the store lazily and again after a failure: an unreachable store at start is a
    warning, and each job that needs it fails with ``Unavailable`` until it is back.

    The store is opened with the node's chunk cache (``[cache]``), which every pull of the
    node reads before the store. A cache that cannot be opened (a full or read-only disk,
    a directory that is not ours) never keeps the store from opening: it is a warning, the
    store opens without one, and the cache is tried again the next time the store is
    opened; ``cache_error`` says why meanwhile.
    """

    def __init__(self, config: Config) -> None:
        self._config = config
        self._store: CheckpointStore | None = None
        self._cache: ChunkCache | None = None
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self.cache_error: str | None = None
        # The latest manifest asked about per workload (``warmth``): status asks again and
        # again about the same one. Holds one manifest per workload (its chunk list).
        self._manifests: dict[str, Manifest] = {}

    @property
    def cache(self) -> ChunkCache | None:
        """The node's chunk cache, once a store was opened with it."""
        return self._cache

    def _chunk_cache(self) -> ChunkCache | None:
        c = self._config.cache
        if not c.enabled:
            return None
        if self._cache is None:
            directory = c.directory(self._config.daemon.state_dir)
            try:
                self._cache = ChunkCache(directory, max_bytes=c.max_bytes)
            except GpusnapError as err:
                self.cache_error = str(err)
                log.warning("chunk cache not used (pulls go to the store): %s", err)
                return None
            self.cache_error = None
        return self._cache

    def get(self) -> CheckpointStore:
        with self._lock:
            if self._store is None:
                s = self._config.store
                try:
                    self._store = open_store(
                        s.url,
                        key_file=s.key_file,
                        encryption_key_file=s.encryption_key_file,
                        options=s.options,
                        verify=s.verify,
                        trusted_keys=s.trusted_keys,
                        cache_dir=s.cache_dir or (self._config.daemon.state_dir / "cache"),
                        workers=s.workers,
                        chunk_cache=self._chunk_cache(),
                        high_water_file=self._config.daemon.state_dir / "heads.json",
                    )
                except GpusnapError as err:
                    self.last_error = str(err)
                    raise
                self.last_error = None
            return self._store

    def warmth(self, checkpoint_id: str) -> dict[str, Any] | None:
        """How much of a checkpoint the node's chunk cache holds, of what a restore of it
        would fetch: ``{checkpoint_id, bytes_warm, bytes_total, fraction}``; ``None`` when
        the store has no cache. One query of the cache's index (and the manifest, the first
        time this checkpoint is asked about)."""
        store = self.get()
        if store.cache is None:
            return None
        with self._lock:
            manifest = next(
                (m for m in self._manifests.values() if m.checkpoint_id == checkpoint_id), None
            )
        if manifest is None:
            manifest = store.manifest(checkpoint_id)  # authenticated
            with self._lock:
                self._manifests[manifest.workload] = manifest
        warm, total = store.warm_bytes(manifest)
        return {
            "checkpoint_id": checkpoint_id,
            "bytes_warm": warm,
            "bytes_total": total,
            "fraction": round(warm / total, 6) if total else 1.0,
        }

    def close(self) -> None:
        with self._lock:
            self._manifests.clear()
            if self._store is not None:
                self._store.close()
                self._store = None
            if self._cache is not None:  # after the store: it may still flush into it
                self._cache.close()
                self._cache = None


class HostFacts:
    """The ``host`` section of this node's stamps, probed once (CRIU's version with it)."""

    def __init__(self, criu: Criu, node_id: str | None) -> None:
        self._criu = criu
        self._node_id = node_id
        self._host: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        if self._host is None:
            major, minor, patch = self._criu.version()
            self._host = host_stamp(criu_version=f"{major}.{minor}.{patch}", node_id=self._node_id)
        return self._host


@dataclass(frozen=True)
class Node:
    """What a job body may use of this node; see the module docstring."""

    config: Config
    criu: Criu
    gpu: GpuAdapter
    store: StoreHandle
    dirs: StateDirs
    host: HostFacts
    reaper: Reaper
    containers: RuntimeSet = field(default_factory=RuntimeSet)  # podman, runc, containerd

    def adopt(self, pid: int, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Reap ``pid`` when it exits (a restored root made our child, or a cold start)."""
        self.reaper.adopt(pid, proc)

    def require_verified(self, what: str) -> None:
        """Refuse to act on a manifest this daemon cannot authenticate: a restore runs the
        checkpointed tree, a cold start runs the manifest's launch spec (as root), so neither
        may come from a store read with ``[store] verify = false``."""
        if not self.config.store.verify:
            raise FailedPrecondition(
                f"refusing to {what}: manifest authenticity is not verified "
                "([store] verify = false)"
            )

    def facts(self, workload: str | None) -> NodeFacts:
        """What the gate compares a stamp with, for ``workload``'s config on this node."""
        return NodeFacts(
            host=self.host.get(),
            gpusnap=gpusnap_stamp(),
            workload=self.config.workload(workload) if workload else None,
            model_digest=lambda d: cache_in(self.dirs.state).directory_digest(d).digest,
        )

    def reasons(self, manifest: Manifest) -> list[Reason]:
        """Every reason ``manifest`` cannot be restored here (empty: compatible)."""
        stamp = manifest.stamp
        reasons = check_compat(stamp, self.facts(manifest.workload))
        gpu_stamp = stamp.get("gpu")
        reasons += self.gpu.compat_reasons(gpu_stamp if isinstance(gpu_stamp, dict) else {})
        reasons += container_gate(self.containers, stamp)
        return reasons
