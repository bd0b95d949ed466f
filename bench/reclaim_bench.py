"""Reclaim benchmark: time from a spot notice to the committed kill-mode checkpoint, and bytes
uploaded, with and without a periodic (leave-running) checkpoint taken beforehand.

For each workload — the demo (``demo/tinylm.py``, generating tokens all along) and a process
holding N GiB of mixed data (``tests/e2e/memory_holder.py``, unchanged while it sleeps) — and
for each case:

- ``cold``: a fresh store; the notice arrives; the reclaim checkpoint uploads everything.
- ``periodic``: a fresh store; the workload's policy has ``checkpoint_interval``, so the
  daemon takes a periodic leave-running checkpoint first; once it committed, the notice
  arrives and the reclaim checkpoint uploads only chunks the store does not hold yet.

The notice is real: a loopback AWS IMDSv2 server (``tests/support/metadata_servers.py``)
starts answering ``spot/instance-action`` with a 2-minute deadline, and a real ``gpusnapd``
(``[triggers] provider = "aws"``, polling every ``--poll`` seconds) notices it, checkpoints
and commits. notice-to-commit = commit time (job ``created_at`` + ``seconds``) - the moment
the server started announcing; it includes the poll delay, which is shown on its own.

Target (issue 5): with a prior periodic checkpoint, the reclaim checkpoint of an
unchanged-but-running workload uploads <= 10% of a full checkpoint's bytes — judged on the
memory holder (unchanged); the demo's ratio is shown too (it changes as it generates).

    .venv/bin/python bench/reclaim_bench.py [--gib 2] [--store file|s3] [--json-out FILE]

``file://`` store by default (moto's single-threaded server would dominate the timings);
``--store s3`` runs the same against a moto S3 server on 127.0.0.1. Prints a table and one
JSON line, and says honestly whether the target was met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench._daemon and tests.*

from bench._daemon import GUARD, adopt_orphans, cli, gpusnapd, poll  # noqa: E402
from gpusnap.daemon.host.criu import Criu  # noqa: E402
from tests.e2e import memory_holder  # noqa: E402
from tests.support.metadata_servers import AwsImdsServer  # noqa: E402
from tests.support.moto_server import MotoServer, aws_test_credentials  # noqa: E402

TINYLM = ROOT / "demo" / "tinylm.py"
TARGET_RATIO = 0.10
NOTICE_S = 120.0  # an AWS spot notice: two minutes


def start_workload(kind: str, work: Path, mib: int) -> subprocess.Popen[bytes]:
    err = open(work / "workload.err", "wb")  # noqa: SIM115 - the child keeps it
    if kind == "tinylm":
        tokens = work / "tokens.txt"
        proc = subprocess.Popen(
            [sys.executable, str(TINYLM), "--out", str(tokens), "--steps", "1000000",
             "--interval", "0.05"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True, cwd=work, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
        )  # fmt: skip

        def ready() -> bool:
            return tokens.exists() and tokens.stat().st_size > 0

    else:
        proc = memory_holder.start(mib, work / "ready", stderr=err, cwd=work)

        def ready() -> bool:
            return (work / "ready").exists()

    poll(f"{kind} to start", lambda: ready() or proc.poll() is not None)
    if proc.poll() is not None:
        raise RuntimeError(f"{kind} exited: {(work / 'workload.err').read_text()[-2000:]}")
    return proc


@contextlib.contextmanager
def s3_store(enabled: bool) -> Iterator[tuple[str, str] | None]:
    """(endpoint, bucket) of a moto server on loopback, or None for file://."""
    if not enabled:
        yield None
        return
    with aws_test_credentials(), MotoServer() as moto:
        moto.create_bucket("reclaim-bench")
        yield moto.endpoint_url, "reclaim-bench"  # each case writes under its own prefix


def run_case(
    kind: str, case: str, work: Path, mib: int, s3: tuple[str, str] | None, poll_s: float
) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store = ""  # file:// in the work dir
    if s3 is not None:
        endpoint, bucket = s3
        prefix = f"{kind}-{case}-{os.getpid()}"
        store = (
            f'url = "s3://{bucket}/{prefix}"\nendpoint_url = "{endpoint}"\n'
            'region = "us-east-1"\naddressing_style = "path"\n'
        )
    proc = start_workload(kind, work, mib)
    (work / "workload.pid").write_text(f"{proc.pid}\n")
    interval = "checkpoint_interval = 86400\n" if case == "periodic" else ""
    try:
        with contextlib.ExitStack() as running:
            imds = running.enter_context(AwsImdsServer())
            sock = running.enter_context(
                gpusnapd(
                    work,
                    store=store,
                    extra=f'[triggers]\nprovider = "aws"\naws_imds_url = "{imds.url}"\n'
                    f"poll_interval = {poll_s}\nlogind = false\n"
                    f'[[workload]]\nname = "{kind}"\npid_file = "{work}/workload.pid"\n'
                    f'on_notice = "checkpoint"\n{interval}',
                )
            )

            periodic: dict[str, Any] | None = None
            if case == "periodic":

                def periodic_done() -> dict[str, Any] | None:
                    for j in cli(sock, "jobs")["jobs"]:
                        if j["trigger"] == "schedule" and j["state"] in ("succeeded", "failed"):
                            return dict(j)
                    return None

                periodic = poll("the periodic checkpoint", periodic_done)
                assert periodic is not None
                if periodic["state"] != "succeeded":
                    raise RuntimeError(f"periodic checkpoint failed: {periodic['error']}")

            notice_at = time.time()
            imds.announce_reclaim("terminate", at=notice_at + NOTICE_S)

            def reclaim_done() -> dict[str, Any] | None:
                for j in cli(sock, "jobs")["jobs"]:
                    if j["trigger"] == "reclaim:aws" and j["state"] in (
                        "succeeded",
                        "failed",
                        "cancelled",
                    ):
                        return dict(j)
                return None

            job = poll("the reclaim checkpoint", reclaim_done)
            if job["state"] != "succeeded":
                raise RuntimeError(f"reclaim checkpoint {job['state']}: {job['error']}")
        r = job["result"]
        committed_at = job["created_at"] + r["seconds"]
        out: dict[str, Any] = {
            "workload": kind,
            "case": case,
            "notice_to_commit_s": round(committed_at - notice_at, 3),
            "poll_delay_s": round(job["created_at"] - notice_at, 3),
            "job_seconds": r["seconds"],
            "pause_s": r.get("pause_seconds"),
            "upload_s": r.get("upload_seconds"),
            "bytes_total": r["bytes_total"],
            "bytes_uploaded": r["bytes_uploaded"],
            "committed_before_deadline": r.get("committed_before_deadline"),
        }
        if periodic is not None:
            pr = periodic["result"]
            out["periodic"] = {
                "seconds": pr.get("seconds"),
                "bytes_total": pr.get("bytes_total"),
                "bytes_uploaded": pr.get("bytes_uploaded"),
            }
        return out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(GUARD)
        with contextlib.suppress(ChildProcessError):  # orphans adopted as child subreaper
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        shutil.rmtree(work, ignore_errors=True)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB the memory holder holds")
    p.add_argument("--store", choices=("file", "s3"), default="file")
    p.add_argument("--poll", type=float, default=1.0, help="IMDS poll period of the daemon (s)")
    p.add_argument("--workdir", type=Path, help="work dir (default /dev/shm/gpusnap-reclaim-…)")
    p.add_argument("--workloads", default="tinylm,holder")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.stderr.write("reclaim_bench: CRIU needs root\n")
        return 1
    Criu().check()
    adopt_orphans()  # reap the workloads' orphans
    base = (args.workdir or Path(f"/dev/shm/gpusnap-reclaim-{os.getpid()}")).resolve()
    mib = int(args.gib * 1024)
    rows: list[dict[str, Any]] = []
    with s3_store(args.store == "s3") as s3:
        for kind in args.workloads.split(","):
            for case in ("cold", "periodic"):
                sys.stderr.write(f"reclaim_bench: {kind} / {case} ...\n")
                rows.append(run_case(kind, case, base / f"{kind}-{case}", mib, s3, args.poll))
    shutil.rmtree(base, ignore_errors=True)

    verdicts: dict[str, Any] = {}
    for kind in args.workloads.split(","):
        cold = next(r for r in rows if r["workload"] == kind and r["case"] == "cold")
        warm = next(r for r in rows if r["workload"] == kind and r["case"] == "periodic")
        ratio = warm["bytes_uploaded"] / max(1, cold["bytes_uploaded"])
        verdicts[kind] = {"upload_ratio": round(ratio, 4), "met": ratio <= TARGET_RATIO}
    judged = "holder" if "holder" in verdicts else next(iter(verdicts))

    header = ["workload", "case", "notice->commit", "poll delay", "pause", "bytes total",
              "uploaded", "before deadline"]  # fmt: skip
    table = [header]
    for r in rows:
        table.append(
            [
                r["workload"] + (f" ({args.gib:g} GiB)" if r["workload"] == "holder" else ""),
                r["case"] + (" (after periodic)" if r["case"] == "periodic" else ""),
                f"{r['notice_to_commit_s']:.2f} s",
                f"{r['poll_delay_s']:.2f} s",
                f"{r['pause_s']:.2f} s" if r["pause_s"] is not None else "-",
                human(r["bytes_total"]),
                human(r["bytes_uploaded"]),
                str(r["committed_before_deadline"]),
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for kind, v in verdicts.items():
        print(
            f"{kind}: reclaim upload after a periodic checkpoint = {v['upload_ratio']:.2%} of a "
            f"full checkpoint (target <= {TARGET_RATIO:.0%}): {'met' if v['met'] else 'NOT MET'}"
        )
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "loadavg": os.getloadavg(),
        },
        "store": args.store,
        "poll_interval_s": args.poll,
        "gib": args.gib,
        "rows": rows,
        "verdicts": verdicts,
        "target": {
            "upload_ratio_max": TARGET_RATIO,
            "judged_on": judged,
            "met": verdicts[judged]["met"],
        },
    }
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
