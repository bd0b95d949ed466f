"""Today's plug point: ``gpusnap.daemon.main`` imports this module by name and calls
``start_triggers(service, config)``.

It only unpacks the daemon's config for ``ReclaimRuntime``. The wiring change of issue 9 (the
daemon builds the runtime itself, from its typed config) deletes this module.
"""

from __future__ import annotations

from typing import Any

from gpusnap.daemon.reclaim.config import parse_workload_policy
from gpusnap.daemon.reclaim.node import NodeDaemon
from gpusnap.daemon.reclaim.runtime import ReclaimRuntime


def start_triggers(service: NodeDaemon, config: Any) -> ReclaimRuntime:
    """A started ``ReclaimRuntime`` from a ``gpusnap.daemon.config.Config`` (not imported here:
    it imports reclaim's config)."""
    runtime = ReclaimRuntime(
        service,
        config.triggers,
        config.migration,
        [parse_workload_policy(w.name, w.policy) for w in config.workloads],
        daemon_node_id=config.daemon.node_id,
        store_verifies=config.store.verify,
    )
    runtime.start()
    return runtime
