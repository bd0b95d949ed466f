"""The gRPC API (``gpusnap/v1/*.proto``) and its generated code. Imports nothing of ours."""
