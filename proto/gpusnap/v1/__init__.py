"""gpusnap API v1: ``gpusnap.proto`` and the code generated from it by ``scripts/gen-proto.sh``.

Import the messages as ``from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb`` and the
stubs and servicers from ``gpusnap_pb2_grpc``. Never edit the generated ``*_pb2*`` files.
"""

# Trailing-metadata key carrying a failed call's error kind (a key of ERROR_TABLE). Part of
# the API contract: the servicer sets it, clients read it to rebuild the same error kind.
ERROR_KIND_METADATA_KEY = "gpusnap-error-kind"
