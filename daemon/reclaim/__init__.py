"""Reclaim: spot-reclaim and shutdown notices become deadline-bound checkpoints, and reclaimed
checkpoints find a new node through the store.

- ``notice``: the ``Notice`` value every part passes on; ``manager``: runs watchers, delivers
  each notice once; ``aws``, ``gcp``, ``azure`` (over ``_http``): each cloud's metadata
  protocol; ``providers``: ``auto`` detection and the watchers ``[triggers]`` asks for;
  ``shutdown``: logind, SIGTERM and the stop-time extension.
- ``policy``: per workload, what a notice or a schedule starts.
- ``board``: the migration board (signed records in the store, claimed exactly once);
  ``standby``: the loop that adopts reclaimed workloads.
- ``config``: the typed ``[triggers]``, ``[migration]`` and per-workload policy tables;
  ``node``: ``NodeDaemon``, all reclaim needs of the daemon; ``runtime``: ``ReclaimRuntime``,
  everything above running in one daemon.

May import ``gpusnap.errors``, ``gpusnap.storage``, ``gpusnap.daemon.jobs`` and
``gpusnap.daemon.infra`` (metrics, systemd notify); never the service, the gRPC layer, the
daemon's config, the gate or the CLI: the daemon hands itself over as a ``NodeDaemon`` (its
verdicts as ``standby.Verdict``) and its config as the typed tables here.
"""
