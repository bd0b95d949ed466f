"""gpusnapd, the node daemon: config, jobs, capture (CRIU for host state, the CUDA checkpoint
API for GPU state), stamp and compatibility gate, cold start, triggers, the gRPC server and
systemd integration.

May import ``gpusnap.storage`` and ``gpusnap.proto``; never ``gpusnap.cli``.
"""
