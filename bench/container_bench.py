"""Container benchmark: podman's own checkpoint against gpusnapd's, on the same container.

Each round starts one podman container running the generation loop
(``tests/containers/workload/genloop.py``, with ``--mib`` MiB of bf16-like weights, so its
pages compress as real weights roughly do) and checkpoints it, leave-running, both ways:

- the baseline: ``podman container checkpoint --leave-running --export FILE --compress none
  --file-locks --print-stats``, then ``zstd -T0 -1`` of the archive (podman's pause is CRIU's
  freezing + frozen time from ``--print-stats``; its commit is the export's wall time plus
  zstd's);
- gpusnap: ``Checkpoints.Create`` of the container through a real ``gpusnapd`` (the daemon's
  ``[containers.podman]`` point at the same storage root) into a ``file://`` store, followed to
  its end (its pause is the job's ``pause_seconds``, CRIU's account from the parts'
  ``stats-dump``; trigger-to-commit runs from the request leaving the client to the job's
  ``finished_at``, both on this machine's clock: the service's look at the container, the job,
  the upload and the signed manifest);
- then, a little later, a second gpusnap checkpoint of the same container: the bytes it
  uploads against the first's.

Targets (issue 13): pause <= 1.1x podman's; trigger-to-commit <= 1.0x podman export + zstd;
second checkpoint <= 15% of the first's bytes. One untimed podman checkpoint warms the
container up; the two sides alternate which goes first, round by round; each round has its
own container, daemon and store (a store that had the weights from an earlier round would
make the first checkpoint cheap). Everything written (the export, the store, the daemon's
staging) lives in ``--workdir`` (tmpfs by default), so the comparison is of the pipelines,
not of disks; so does podman's own storage root, where CRIU writes its images first on both
sides (``--podman-root``). Before each timed checkpoint the bench syncs and waits
``--settle`` seconds: without it, whichever side went second paid for the first's writeback
(measured: up to 2x on the pause).

    .venv/bin/python bench/container_bench.py [--mib 512] [--rounds 3] [--settle 3]
                                              [--json-out FILE]

Root, podman, runc and CRIU 4.x (scripts/install-containers.sh, install-criu.sh). Prints a
table and one JSON line; says honestly which targets were met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpusnap.cli._client import DaemonClient  # noqa: E402
from gpusnap.daemon.containers import ContainerSpec, Mount, PodmanRuntime, Ulimit  # noqa: E402
from gpusnap.storage import generate_signing_key  # noqa: E402
from tests.containers.image import IMAGE_REF, WORKLOAD_DIR, image_archive  # noqa: E402
from tests.support.daemons import Node  # noqa: E402

GUARD = 1800.0  # seconds; against hangs only
ULIMITS = (Ulimit("nofile", 20000, 20000), Ulimit("nproc", 32768, 32768))
TARGETS = {
    "pause": (1.1, "pause <= 1.1x podman's"),
    "commit": (1.0, "trigger-to-commit <= 1.0x podman export + zstd"),
    "second": (0.15, "second checkpoint <= 15% of the first's bytes"),
}


def timed(argv: list[str]) -> tuple[float, str]:
    t = time.monotonic()
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=GUARD, check=False, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... failed: {proc.stderr.strip()[-500:]}")
    return time.monotonic() - t, proc.stdout


def lines(out: Path) -> int:
    try:
        return (out / "tokens").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_lines(out: Path, n: int, rt: PodmanRuntime, name: str) -> None:
    end = time.monotonic() + GUARD
    while lines(out) < n:
        if time.monotonic() > end:
            raise TimeoutError(f"the container never reached step {n}")
        if not rt.inspect(name).running:
            logs = rt.tool.run(["logs", name], what="logs", check=False)
            raise RuntimeError(f"container {name} exited: {logs.stderr.strip()[-500:]}")
        time.sleep(0.2)


def settle(seconds: float) -> None:
    """Before a timed checkpoint: what the last one wrote is on disk, and the machine has had
    a moment; otherwise whichever side goes second pays for the first's writeback."""
    os.sync()
    time.sleep(seconds)


class Daemon:
    """One gpusnapd over a fresh ``file://`` store, reaching the benchmark's podman root."""

    def __init__(self, base: Path, key: Path, podman: dict[str, str]) -> None:
        base.mkdir(parents=True)
        options = "".join(f"{k} = {json.dumps(v)}\n" for k, v in podman.items())
        # The test suite's daemon harness: started, and waited for on its READY=1.
        self.node = Node(
            "bench",
            base,
            f"file://{base / 'store'}",
            key,
            extra_config=f'[containers]\ndetect = ["podman"]\n[containers.podman]\n{options}',
            log_level="info",
        )
        self.node.start()
        self.client = DaemonClient.for_socket(self.node.socket)

    def checkpoint(self, name: str) -> tuple[dict[str, Any], float]:
        """The finished job, and trigger-to-commit: from the request to ``finished_at``."""
        t0 = time.time()
        job = self.client.checkpoint(container=name, leave_running=True)
        for snapshot in self.client.watch_job(job["id"]):
            job = snapshot
            if job["state"] in ("succeeded", "failed", "cancelled", "interrupted"):
                break
        if job["state"] != "succeeded":
            raise RuntimeError(f"gpusnap checkpoint {job['state']}: {job['error']}")
        return job, float(job["finished_at"]) - t0

    def stop(self) -> None:
        self.client.close()
        self.node.stop()


def podman_baseline(rt: PodmanRuntime, name: str, work: Path) -> dict[str, Any]:
    archive = work / "export.tar"
    args = [rt.tool.binary(), *rt.tool.base_args, "container", "checkpoint", "--leave-running"]
    args += ["--export", str(archive), "--compress", "none", "--file-locks", "--print-stats"]
    export_s, out = timed([*args, name])
    stats = json.loads(out[out.index("{") :])["container_statistics"][0]["criu_statistics"]
    zstd_s, _ = timed(["zstd", "-q", "-f", "-T0", "-1", str(archive), "-o", f"{archive}.zst"])
    sizes = (archive.stat().st_size, Path(f"{archive}.zst").stat().st_size)
    archive.unlink()
    Path(f"{archive}.zst").unlink()
    return {
        "pause_s": (stats.get("freezing_time", 0) + stats["frozen_time"]) / 1e6,
        "export_s": export_s,
        "zstd_s": zstd_s,
        "commit_s": export_s + zstd_s,
        "archive_bytes": sizes[0],
        "zst_bytes": sizes[1],
    }


def one_round(
    i: int, rt: PodmanRuntime, image_id: str, args: argparse.Namespace, work: Path, key: Path
) -> dict[str, Any]:
    base = work / f"round-{i}"
    out = base / "out"
    out.mkdir(parents=True)
    name = f"bench-{os.getpid()}-{i}"
    spec = ContainerSpec(
        image=IMAGE_REF,
        image_id=image_id,
        command=("python3", "/gen/genloop.py", "/out", "100000000", "0.02", str(args.mib)),
        env=("GENLOOP_WEIGHTS=bf16",),
        mounts=(Mount("/gen", str(WORKLOAD_DIR), options=("ro",)), Mount("/out", str(out))),
        ulimits=ULIMITS,
    )
    daemon = Daemon(base / "daemon", key, args.podman_options)
    rt.create(spec, name=name)
    try:
        wait_lines(out, 5, rt, name)  # the weights are built
        podman_baseline(rt, name, base)  # warm-up, not counted
        order = ["podman", "gpusnap"] if i % 2 == 0 else ["gpusnap", "podman"]
        res: dict[str, Any] = {"order": order, "load_start": os.getloadavg()[0]}
        for side in order:
            settle(args.settle)
            if side == "podman":
                res["podman"] = podman_baseline(rt, name, base)
            else:
                job, commit = daemon.checkpoint(name)
                r = job["result"]
                res["gpusnap"] = {
                    "pause_s": float(r["pause_seconds"]),
                    "commit_s": commit,
                    "job_seconds": float(r["seconds"]),
                    "dump_s": float(r["dump_seconds"]),
                    "upload_s": float(r["upload_seconds"]),
                    "bytes_total": int(r["bytes_total"]),
                    "bytes_uploaded": int(r["bytes_uploaded"]),
                }
        wait_lines(out, lines(out) + args.steps_between, rt, name)
        settle(args.settle)
        job, _ = daemon.checkpoint(name)
        res["second"] = {
            "bytes_total": int(job["result"]["bytes_total"]),
            "bytes_uploaded": int(job["result"]["bytes_uploaded"]),
        }
        res["load_end"] = os.getloadavg()[0]
        return res
    finally:
        rt.remove(name)
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def ratios(r: dict[str, Any]) -> dict[str, float]:
    g, p = r["gpusnap"], r["podman"]
    return {
        "pause": g["pause_s"] / p["pause_s"],
        "commit": g["commit_s"] / p["commit_s"],
        "second": r["second"]["bytes_uploaded"] / g["bytes_uploaded"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="the container's weights (MiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-between", type=int, default=50, help="steps between 1st and 2nd")
    p.add_argument("--workdir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--podman-root", type=Path, default=Path("/dev/shm"))
    p.add_argument("--settle", type=float, default=3.0, help="seconds before each timed side")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    if os.geteuid() != 0:
        print("container_bench: needs root (podman, CRIU)", file=sys.stderr)
        return 2
    # A SIGTERM (a timeout, a killed session) still cleans up: containers, daemon, scratch.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="gpusnap-ctr-bench-", dir=args.workdir))
    storage = Path(tempfile.mkdtemp(prefix="gpusnap-ctr-bench-", dir=args.podman_root))
    run_dir = Path(tempfile.mkdtemp(prefix="gpusnap-cb-", dir="/tmp"))  # runroot <= 50 chars
    rt = PodmanRuntime(
        root=storage / "root",
        runroot=run_dir / "run",
        tmpdir=run_dir / "tmp",
        runtime_root=run_dir / "runc",
        cgroup_manager="cgroupfs",  # no systemd as PID 1 here
        events_backend="file",
    )
    args.podman_options = {  # the same root, for the daemon's [containers.podman]
        "root": str(storage / "root"),
        "runroot": str(run_dir / "run"),
        "tmpdir": str(run_dir / "tmp"),
        "runtime_root": str(run_dir / "runc"),
        "cgroup_manager": "cgroupfs",
        "events_backend": "file",
    }
    key = work / "signing.key"
    generate_signing_key(key)
    rounds: list[dict[str, Any]] = []
    try:
        rt.tool.run(["load", "--input", str(image_archive())], what="load", timeout=GUARD)
        proc = rt.tool.run(["image", "inspect", "--format", "{{.Id}}", IMAGE_REF], what="inspect")
        image_id = "sha256:" + proc.stdout.strip()
        for i in range(args.rounds):
            r = one_round(i, rt, image_id, args, work, key)
            r["ratios"] = ratios(r)
            rounds.append(r)
            print(f"round {i}: {json.dumps({k: round(v, 4) for k, v in r['ratios'].items()})}")
    finally:
        rt.tool.run(["rm", "--all", "--force", "--time", "0"], what="rm", check=False)
        rt.tool.run(["system", "reset", "--force"], what="reset", check=False)
        for d in (work, storage, run_dir):
            shutil.rmtree(d, ignore_errors=True)
    report = summarize(rounds, args)
    print(json.dumps(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    return 0


def summarize(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rows = [
        ("podman pause (CRIU freezing + frozen)", [r["podman"]["pause_s"] for r in rounds], "s"),
        ("gpusnap pause", [r["gpusnap"]["pause_s"] for r in rounds], "s"),
        ("podman export", [r["podman"]["export_s"] for r in rounds], "s"),
        ("zstd -T0 -1 of the archive", [r["podman"]["zstd_s"] for r in rounds], "s"),
        ("podman export + zstd", [r["podman"]["commit_s"] for r in rounds], "s"),
        ("gpusnap trigger-to-commit", [r["gpusnap"]["commit_s"] for r in rounds], "s"),
        ("  of which the runtime's checkpoint", [r["gpusnap"]["dump_s"] for r in rounds], "s"),
        ("  of which the upload", [r["gpusnap"]["upload_s"] for r in rounds], "s"),
        ("archive (uncompressed)", [r["podman"]["archive_bytes"] / 1e6 for r in rounds], "MB"),
        ("archive, zstd", [r["podman"]["zst_bytes"] / 1e6 for r in rounds], "MB"),
        ("gpusnap first: uploaded", [r["gpusnap"]["bytes_uploaded"] / 1e6 for r in rounds], "MB"),
        ("gpusnap second: uploaded", [r["second"]["bytes_uploaded"] / 1e6 for r in rounds], "MB"),
    ]
    print(f"container_bench: {args.mib} MiB of weights, {len(rounds)} rounds")
    for label, values, unit in rows:
        print(f"  {label:40s} " + "  ".join(f"{v:8.3f}" for v in values) + f" {unit}")
    verdicts: dict[str, Any] = {}
    for name, (limit, words) in TARGETS.items():
        values = [r["ratios"][name] for r in rounds]
        median = statistics.median(values)
        met = sum(v <= limit for v in values)
        verdicts[name] = {
            "target": words,
            "ratios": [round(v, 4) for v in values],
            "median": round(median, 4),
            "met_median": median <= limit,
            "rounds_met": f"{met}/{len(values)}",
        }
        state = "met" if median <= limit else "NOT met"
        print(f"  {words}: median {median:.3f} ({state}; {met}/{len(values)} rounds)")
    return {"mib": args.mib, "rounds": rounds, "targets": verdicts}


if __name__ == "__main__":
    sys.exit(main())
