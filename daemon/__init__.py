"""gpusnapd, the node daemon, in rooms named for what they hold.

At the top: ``main`` (the process: config, lock, CRIU check, service, API, systemd),
``config`` (+ ``config_table``), ``service`` (``DaemonService``, what the API asks),
``status``, ``node`` (``Node``: what a job body may use), the job bodies ``checkpoint``,
``restore`` and ``rescue``, ``stamp`` (what a checkpoint carries), ``compat`` and ``verdict``
(the gate), ``gpu_memory`` (device memory in the store), ``gpu_tree`` (a tree's GPU facts
for the stamp, and a tree whose GPU restore failed), ``hooks`` (per-workload commands around a
checkpoint and a restore), ``statedir``, ``metrics``, ``sdnotify``; for containers the bodies
``container_checkpoint`` and ``container_restore``, ``container_stamp`` (their stamp section
and gate rules), ``container_upload`` (parts uploaded during the export) and
``container_config`` (``[containers]``). Rooms: ``jobs/`` (job, executor, journal), ``host/``
(/proc, CRIU, cold start), ``gpu/`` (the CUDA checkpoint layer), ``containers/`` (podman,
runc, containerd), ``api`` and ``reclaim`` (triggers and migration).

May import ``gpusnap.storage``, ``gpusnap.proto`` and ``gpusnap.errors``; never ``gpusnap.cli``.
``gpu/`` never imports ``gpusnap.storage`` (its copies go through callables it is given), and
nothing but ``main`` imports ``service`` (the API types it by a Protocol).
"""
