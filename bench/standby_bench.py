"""Warm standby benchmark: the same checkpoint restored on a standby that prefetched its parent
and on one that did not, over a bandwidth-limited remote store (issue 14: the warm restore
fetches <= 10% of the image's bytes and takes <= 0.3x the cold one, request to running).

    .venv/bin/python bench/standby_bench.py [--mib 1024] [--rounds 3] [--store-rate 50MB/s]
                                            [--workdir /var/tmp] [--json-out FILE]

Root and CRIU 4.x. The store is a moto S3 server on 127.0.0.1 behind a throttling proxy
(``tests/support/faultproxy.py``, ``throttle``): every byte any node downloads goes through one
line of ``--store-rate`` (default 50 MB/s, 0.4 Gbit/s), all connections together; uploads are
not throttled. Real gpusnapd daemons, the real CLI, real CRIU on a real process
(``tests/e2e/memory_holder.py``, ``--mib`` of mixed data). Each round:

1. node A checkpoints the process, leaving it running (``cp1``);
2. node W (``[migration] prefetch = true``) starts and prefetches ``cp1`` into its chunk cache
   (the bench waits until ``gpusnap status`` on W shows it 100% warm); node C (a standby with
   the same config but no prefetch) starts too;
3. the process changes 5% of its memory; A checkpoints it in kill mode (``cp2``), as a
   reclaim does;
4. ``gpusnap restore cp2 --wait`` on W, then (the restored process killed) on C, or the other
   way round in every other round. Request to running is the wall time of that command
   (request sent to the restored tree running: fetch, CRIU restore, GPU restore). The bytes
   come from the restore job's result (``bytes_fetched`` from the store, ``bytes_cached``).

Ratios are of the same round; the JSON has every figure and the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reclaim_bench import poll  # noqa: E402
from bench.store_bench import machine  # noqa: E402
from tests.e2e_reclaim.cluster import Cluster, triggers_section  # noqa: E402
from tests.support.daemons import Node, Nodes  # noqa: E402
from tests.support.faultproxy import FaultProxy  # noqa: E402
from tests.support.holder import Holder  # noqa: E402
from tests.support.moto_server import MotoServer, aws_test_credentials  # noqa: E402

GUARD = 1800.0
FETCHED_TARGET = 0.10
TIME_TARGET = 0.30
NAME = "holder"


def cli(node: Node, *args: str) -> Any:
    res = node.cli(*args, "--json", timeout=GUARD)
    if res.rc != 0:
        raise RuntimeError(f"gpusnap {' '.join(args)} on {node.name}: {res.stderr}\n{node.log()}")
    return res.json


def parse_rate(text: str) -> float:
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]?)b(?:/s)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (e.g. 50MB/s)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def workload(pid_file: Path | None = None) -> str:
    finder = f'pid_file = "{pid_file}"\n' if pid_file else ""
    return f'\n[[workload]]\nname = "{NAME}"\n{finder}on_notice = "none"\n'


def warm_fraction(node: Node) -> float:
    for w in cli(node, "status")["workloads"]:
        if w["name"] == NAME and w["warm"]:
            return float(w["warm"]["fraction"])
    return 0.0


def restore(node: Node, checkpoint: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = cli(node, "restore", checkpoint, "--wait")
    wall = time.perf_counter() - t0
    if result.get("mode") != "restored":
        raise RuntimeError(f"restore on {node.name} did not restore: {result}")
    return {
        "request_to_running_s": round(wall, 3),
        "job_seconds": result["seconds"],
        "fetch_seconds": result["fetch_seconds"],
        "restore_seconds": result["restore_seconds"],
        "bytes_total": result["bytes_total"],
        "bytes_fetched": result["bytes_fetched"],
        "bytes_cached": result["bytes_cached"],
    }


def one_round(base: Path, moto: MotoServer, rate: float, mib: int, warm_first: bool) -> Any:
    nodes = Nodes(base)
    holder: Holder | None = None
    try:
        with FaultProxy(moto.endpoint_url) as proxy:
            proxy.throttle(rate)
            bucket = f"standby-{uuid.uuid4().hex[:12]}"
            moto.create_bucket(bucket)
            cluster = Cluster(nodes, moto, bucket)
            holder = Holder(base, mib)
            a = cluster.node("a", triggers_section("none") + workload(holder.pid_file))
            t0 = time.perf_counter()
            cp1 = cli(a, "checkpoint", "--workload", NAME, "--leave-running", "--wait")
            first_s = time.perf_counter() - t0
            standby = "[migration]\nstandby = true\npoll_interval = 3600\n"
            w = cluster.node(
                "w",
                triggers_section("none") + standby + "prefetch = true\n" + workload(),
                endpoint_url=proxy.endpoint_url,
            )
            c = cluster.node(
                "c", triggers_section("none") + standby + workload(),
                endpoint_url=proxy.endpoint_url,
            )  # fmt: skip
            t0 = time.perf_counter()
            poll("W to hold all of cp1", lambda: warm_fraction(w) >= 1.0)
            prefetch_s = time.perf_counter() - t0
            holder.change()
            cp2 = cli(a, "checkpoint", "--workload", NAME, "--wait")  # kill mode
            holder.proc.wait(GUARD)
            out: dict[str, Any] = {
                "load_average_before": os.getloadavg(),
                "first_checkpoint_s": round(first_s, 3),
                "first_checkpoint_bytes": cp1["bytes_total"],
                "prefetch_to_warm_s": round(prefetch_s, 3),
                "second_checkpoint_uploaded": cp2["bytes_uploaded"],
                "order": "warm, cold" if warm_first else "cold, warm",
            }
            for name, node in (
                (("warm", w), ("cold", c)) if warm_first else (("cold", c), ("warm", w))
            ):
                out[name] = restore(node, cp2["checkpoint_id"])
                holder.kill_restored()
    finally:
        nodes.close()
        if holder is not None:
            holder.kill_restored()
            with contextlib.suppress(ChildProcessError):
                holder.proc.wait(5)
    warm, cold = out["warm"], out["cold"]
    out["fetched_fraction"] = round(warm["bytes_fetched"] / warm["bytes_total"], 4)
    out["time_ratio"] = round(warm["request_to_running_s"] / cold["request_to_running_s"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--store-rate", type=parse_rate, default=50e6, metavar="RATE")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rounds = []
    with aws_test_credentials(), MotoServer() as moto:
        for i in range(args.rounds):
            base = Path(tempfile.mkdtemp(prefix=f"gpusnap-standby-{i}-", dir=args.workdir))
            try:
                r = one_round(base, moto, args.store_rate, args.mib, warm_first=i % 2 == 0)
            finally:
                subprocess.run(["rm", "-rf", str(base)], check=False)
            rounds.append(r)
            w, c = r["warm"], r["cold"]
            print(
                f"round {i + 1} ({r['order']}): warm {w['request_to_running_s']:.2f}s fetched "
                f"{w['bytes_fetched'] / 1e6:.1f} MB of {w['bytes_total'] / 1e6:.1f} MB "
                f"({100 * r['fetched_fraction']:.1f}%); cold {c['request_to_running_s']:.2f}s "
                f"fetched {c['bytes_fetched'] / 1e6:.1f} MB; time ratio {r['time_ratio']:.3f}",
                flush=True,
            )
    fetched = statistics.median(r["fetched_fraction"] for r in rounds)
    ratio = statistics.median(r["time_ratio"] for r in rounds)
    doc = {
        "machine": machine(),
        "mib": args.mib,
        "store": f"moto S3 on 127.0.0.1, downloads through a proxy at {args.store_rate:.0f} B/s",
        "rounds": rounds,
        "median_fetched_fraction": fetched,
        "median_time_ratio": ratio,
        "targets": {"fetched_fraction": FETCHED_TARGET, "time_ratio": TIME_TARGET},
        "met_median": {"fetched": fetched <= FETCHED_TARGET, "time": ratio <= TIME_TARGET},
        "rounds_met": {
            "fetched": sum(r["fetched_fraction"] <= FETCHED_TARGET for r in rounds),
            "time": sum(r["time_ratio"] <= TIME_TARGET for r in rounds),
        },
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
