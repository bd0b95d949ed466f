"""The gRPC API (``gpusnap/v1/*.proto``), its generated code, and ``wire.py``, the one
hand-written translation between its messages and plain values (used by the daemon's
servicers and the CLI's client). Imports nothing of ours but ``gpusnap.errors``."""
