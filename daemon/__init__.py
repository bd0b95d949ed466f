"""gpusnapd, the node daemon, in packages named for what they hold (top to bottom, each may
import only those below it; ``docs/architecture.md`` is the map):

- ``main`` (the process: config, lock, CRIU check, service, API, systemd) and ``service``
  (``DaemonService``, what the API asks); ``api/``: the gRPC front.
- ``pipelines/``: the checkpoint and restore job bodies of both subjects (a process tree:
  ``checkpoint``, ``restore``; a container: ``container_checkpoint``, ``container_restore``)
  and their shared phases (hooks, progress, GPU memory and GPU tree, rescue, recovery).
- ``node/``: ``Node``, what a job body may use of this node; the store check; the status.
- ``gpu/``: the CUDA checkpoint layer.
- ``gate/``: the stamp a checkpoint carries and every reason it cannot restore here.
- ``config/``: the one TOML file, every table.
- ``reclaim/``: triggers and migration; ``containers/``: podman, runc, containerd;
  ``host/``: /proc, CRIU, cold start; ``infra/``: state directories, metrics, systemd notify;
  ``jobs/``: job, executor, journal.

May import ``gpusnap.storage``, ``gpusnap.proto`` and ``gpusnap.errors``; never ``gpusnap.cli``.
"""
