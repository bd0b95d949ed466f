"""``gpusnap``, the operator CLI: talks to gpusnapd through the gRPC stubs, and works on a
store directly with ``gpusnap store ...``.

May import ``gpusnap.proto`` and ``gpusnap.storage``; never ``gpusnap.daemon``.
"""
