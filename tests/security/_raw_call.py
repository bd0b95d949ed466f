"""Make one raw gRPC call as another user and print its status code: ``python _raw_call.py USER
SOCKET PID`` (as root) asks for a kill-mode checkpoint of PID and prints e.g.
``PERMISSION_DENIED <kind> <details>``, or ``OK <job id>``.

Like ``tests/api/_as_user.py``: the interpreter starts as root, imports grpc and the stubs, then
becomes USER (with its groups from /etc/group) before it connects.
"""

from __future__ import annotations

import os
import pwd
import sys
from typing import cast

import grpc

from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc

if __name__ == "__main__":
    user = pwd.getpwnam(sys.argv[1])
    os.initgroups(user.pw_name, user.pw_gid)
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)
    with grpc.insecure_channel(f"unix:{sys.argv[2]}") as channel:
        stub = pb_grpc.CheckpointsStub(channel)
        try:
            job = stub.Create(pb.CreateCheckpointRequest(pid=int(sys.argv[3])), timeout=60)
        except grpc.RpcError as err:
            call = cast(grpc.Call, err)
            kinds = {str(k): str(v) for k, v in call.trailing_metadata() or ()}
            print(call.code().name, kinds.get("gpusnap-error-kind", "-"), call.details())
        else:
            print("OK", job.id)
