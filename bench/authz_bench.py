"""What the API socket's front costs: a round trip through it against gRPC's own socket.

    .venv/bin/python bench/authz_bench.py [--calls 2000] [--connections 200] [--repeat 3]

The same servicers and a service that answers ``Status`` at once, served twice in one
process: (a) ``front``: ``start_server`` as gpusnapd runs it (the public socket owned by the
front, which reads ``SO_PEERCRED`` and splices each connection to gRPC's private socket);
(b) ``direct``: a gRPC server on its own unix socket, every caller taken as root (no front).
Measured in each round, alternately: the median of ``--calls`` sequential ``Status`` calls on
one channel (a round trip), and the median of ``--connections`` fresh channels each making
one call (connect + credentials + first call). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpusnap.daemon.api.callers import Caller
from gpusnap.daemon.api.listeners import start_server, stop_server
from gpusnap.daemon.api.servicers import add_servicers
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc


class StatusOnly:
    """Enough of ``DaemonServiceAPI`` for ``Status``; the rest is never called."""

    def for_caller(self, caller: Caller) -> StatusOnly:
        return self

    def status(self) -> Mapping[str, Any]:
        return {"version": "bench", "node_id": "bench"}


def _calls(target: str, n: int) -> float:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.DaemonStub(channel)
        stub.Status(pb.StatusRequest())  # connect first
        times = []
        for _ in range(n):
            t = time.perf_counter()
            stub.Status(pb.StatusRequest())
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _connections(target: str, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        with grpc.insecure_channel(target) as channel:
            pb_grpc.DaemonStub(channel).Status(pb.StatusRequest())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gpusnap-authz-bench-"))
    service = StatusOnly()
    front_path = work / "front.sock"
    front = start_server(service, socket_path=front_path, socket_group=None)  # type: ignore[arg-type]
    direct = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    add_servicers(direct, service, lambda _ctx: Caller(uid=0, gid=0))  # type: ignore[arg-type]
    direct_path = work / "direct.sock"
    direct.add_insecure_port(f"unix:{direct_path}")
    direct.start()
    rounds = []
    try:
        for _ in range(args.repeat):
            r: dict[str, float] = {}
            for name, path in (("direct", direct_path), ("front", front_path)):
                r[f"{name}_call_us"] = round(_calls(f"unix:{path}", args.calls) * 1e6, 1)
                r[f"{name}_connect_us"] = round(
                    _connections(f"unix:{path}", args.connections) * 1e6, 1
                )
            rounds.append(r)
    finally:
        stop_server(front, front_path, grace=None)
        direct.stop(None).wait()
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    median["call_overhead_us"] = round(median["front_call_us"] - median["direct_call_us"], 1)
    median["connect_overhead_us"] = round(
        median["front_connect_us"] - median["direct_connect_us"], 1
    )
    print(json.dumps({"rounds": rounds, "median": median}, indent=2))


if __name__ == "__main__":
    main()
