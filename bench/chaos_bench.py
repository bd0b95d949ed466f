"""The chaos suite at length: every fault of ``tests/chaos/scenarios.py``, N rounds each.

    .venv/bin/python bench/chaos_bench.py --chaos-rounds 20 [--seed S] [--json-out FILE]
                                          [--only kill-file,storms,...]

The same scenarios, harness and audit as ``tests/chaos`` (which runs 3 rounds of each in CI),
with real ``gpusnap`` processes, real files, a small real tmpfs for the full disk (root; left
out otherwise) and a moto server behind the fault-injecting proxy on 127.0.0.1. Prints, per
scenario and in all: faults injected (and armed but missed: the push ended first),
checkpoints verified (each listed checkpoint pulled back byte-identical after each fault),
damage verify named exactly, and checkpoints lost, which must be 0. A failure prints the
seed that replays it (``--seed``, or ``GPUSNAP_CHAOS_SEED`` for the pytest suite).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.chaos and tests.support

import pytest  # noqa: E402  (mounted_tmpfs skips through pytest where it cannot mount)

from tests.chaos import scenarios  # noqa: E402
from tests.chaos.harness import ChaosFailure, ChaosStore, Tally  # noqa: E402
from tests.storage.store_helpers import mounted_tmpfs  # noqa: E402
from tests.support.faultproxy import FaultProxy  # noqa: E402
from tests.support.moto_server import MotoServer, aws_test_credentials  # noqa: E402

SCENARIOS = (
    "kill-file",
    "kill-s3",
    "storms",
    "full-disk",
    "push-gc",
    "recreated-file",
    "recreated-s3",
    "removed-file",
    "removed-s3",
)


def run_one(
    name: str, work: Path, seed: int, rounds: int, moto: MotoServer
) -> tuple[Tally, float, str | None]:
    """One scenario; its tally, seconds, and why it was skipped (or ``None``)."""
    rng = random.Random(f"{seed}/{name}")
    started = time.monotonic()
    work.mkdir(parents=True)
    if name == "full-disk":
        try:
            with mounted_tmpfs(work / "disk", "28m") as disk:
                store = ChaosStore.on_file(work / "w", seed, root=disk / "store")
                scenarios.full_disk(store, rng, rounds)
        except pytest.skip.Exception as exc:
            return Tally(), 0.0, str(exc)
        return store.tally, time.monotonic() - started, None
    if name.endswith("-file") or name == "push-gc":
        store = ChaosStore.on_file(work, seed)
        run: Callable[[], None] = {
            "kill-file": lambda: scenarios.kill_pushes(store, rng, rounds),
            "push-gc": lambda: scenarios.pushes_and_gc(store, rng, rounds),
            "recreated-file": lambda: scenarios.store_recreated(store, rng, rounds),
            "removed-file": lambda: scenarios.chunk_removed(store, rng, rounds),
        }[name]
        run()
        return store.tally, time.monotonic() - started, None
    proxy = FaultProxy(moto.endpoint_url)
    proxy.start()
    try:
        bucket = f"chaos-{uuid.uuid4().hex[:12]}"
        store = ChaosStore.on_s3(work, seed, moto, bucket, proxy.endpoint_url)
        {
            "kill-s3": lambda: scenarios.kill_pushes(store, rng, rounds, proxy),
            "storms": lambda: scenarios.s3_storms(store, proxy, rng, rounds),
            "recreated-s3": lambda: scenarios.store_recreated(store, rng, rounds),
            "removed-s3": lambda: scenarios.chunk_removed(store, rng, rounds),
        }[name]()
    finally:
        proxy.stop()
    return store.tally, time.monotonic() - started, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chaos-rounds", type=int, default=20, help="rounds of each fault")
    ap.add_argument("--seed", type=int, help="replay a run (default: a new seed, printed)")
    ap.add_argument("--only", help=f"comma-separated scenarios (of {', '.join(SCENARIOS)})")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"), help="scratch parent")
    ap.add_argument("--json-out", type=Path, help="also write the JSON result here")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    chosen = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    print(f"chaos seed {seed}, {args.chaos_rounds} rounds of each fault", file=sys.stderr)
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpusnap-chaos-", dir=args.workdir))
    total = Tally()
    result: dict[str, Any] = {"seed": seed, "rounds": args.chaos_rounds, "scenarios": {}}
    load_before = os.getloadavg()
    try:
        with aws_test_credentials(), MotoServer() as moto:
            for name in chosen:
                print(f"-- {name}", file=sys.stderr)
                try:
                    tally, seconds, skipped = run_one(
                        name, work / name, seed, args.chaos_rounds, moto
                    )
                except ChaosFailure as exc:
                    print(f"FAILED {name}: {exc}", file=sys.stderr)
                    result["failed"] = {"scenario": name, "error": str(exc)}
                    break
                total.add(tally)
                result["scenarios"][name] = {
                    **tally.as_dict(),
                    "seconds": round(seconds, 1),
                    "skipped": skipped,
                }
                print(f"   {json.dumps(result['scenarios'][name])}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["total"] = total.as_dict()
    result["load_average_1_5_15"] = {"before": load_before, "after": os.getloadavg()}
    print(json.dumps(result, indent=2, sort_keys=True))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 1 if "failed" in result or total.checkpoints_lost else 0


if __name__ == "__main__":
    sys.exit(main())
