"""The ``gpusnap`` protobuf package (``proto/gpusnap/<version>/``); see ``v1``."""
