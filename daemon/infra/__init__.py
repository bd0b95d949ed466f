"""The daemon process's plumbing, below everything that reports through it.

``statedir``: the state directory, its lock and job directories; ``metrics``: the Prometheus
registry and endpoint; ``sdnotify``: systemd's notify protocol.
"""
