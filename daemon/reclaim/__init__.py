"""Reclaim triggers: cloud spot/preemption watchers, node shutdown, and the policy that turns
their notices into deadline-bound checkpoints.

``base`` holds the ``Notice`` value and the ``TriggerManager`` that runs watchers; ``aws``,
``gcp`` and ``azure`` speak each provider's instance metadata protocol; ``shutdown`` hooks
SIGTERM and logind; ``policy`` decides, per workload, what a notice starts; ``config`` parses
the ``[triggers]`` table. This package may import ``gpusnap.storage`` (errors) and
``gpusnap.daemon.model``; it never imports the service, the gRPC layer or the CLI — the daemon
wires it in through the small protocols defined here.
"""

from gpusnap.daemon.reclaim.manager import Notice, NoticeKind, TriggerManager, Watcher, WatcherState

__all__ = ["Notice", "NoticeKind", "TriggerManager", "Watcher", "WatcherState"]
