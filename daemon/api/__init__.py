"""gpusnapd's gRPC front: the servicers (wire shape only) and the listeners (socket, mTLS).

Imports ``gpusnap.proto`` and ``gpusnap.errors``, nothing else of ours: what it asks of the
daemon is ``DaemonServiceAPI``, which ``daemon/service.py``'s ``DaemonService`` satisfies.
"""

from gpusnap.daemon.api.listeners import TcpListenerConfig, start_server, stop_server
from gpusnap.daemon.api.service_api import DaemonServiceAPI

__all__ = ["DaemonServiceAPI", "TcpListenerConfig", "start_server", "stop_server"]
