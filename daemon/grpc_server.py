"""Moved to ``gpusnap.daemon.api`` (issue 9). Only ``daemon/main.py`` still imports this name;
at the merge its import becomes ``from gpusnap.daemon.api import ...`` and this file goes."""

from gpusnap.daemon.api import TcpListenerConfig, start_server, stop_server

__all__ = ["TcpListenerConfig", "start_server", "stop_server"]
