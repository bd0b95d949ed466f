"""Store benchmark: gpusnap's push/pull against the bare tools, measured in the same run.

    .venv/bin/python bench/store_bench.py [--size-gib 2] [--s3-size-mib 256] [--repeat N]
                                          [--workers W] [--json-out FILE]

Builds a synthetic GPU-like image (bench/_synthetic.py) in a scratch directory and measures:

a) push to a fresh file:// store vs ``zstd -T0 -1`` over the same bytes (compression stage
   alone, output discarded) and vs ``cp`` + ``sync`` of the same bytes (disk stage alone);
b) an incremental push after 5% of the bytes change in a few contiguous regions and a few
   pages are inserted near the start of one file: bytes uploaded and time vs the first push;
   and what guarding it costs (issue 12): the time the commit waited on the proof that the
   chunks it skipped are in the store, and the proof run alone on the same chunks (what it
   would cost with nothing to overlap), each as a ratio to that incremental push;
c) pull vs ``zstd -d`` of the same data: to /dev/null (decompression alone: the baseline the
   issue's target names) and to a file on the same filesystem followed by ``sync`` (like for
   like: pull writes files);
d) against a moto S3 server on loopback: push vs a plain boto3 ``upload_file`` (default
   TransferConfig) of the same bytes to the same server, on a smaller image; then an
   incremental push there, and the proof's cost as a ratio to it (moto's own, not S3's).

Reads are warm (the image was just written; dropping the page cache is not reliable here),
for gpusnap and the baselines alike. With ``--repeat N`` the file:// part (image, baselines,
pushes, pull) runs N times, each gpusnap figure next to baselines of the same round, and the
median of each ratio is reported too: on a shared machine only same-round ratios mean much.
Prints a table per round, then one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support (MotoServer) and bench._synthetic

import boto3  # noqa: E402

from bench._synthetic import GiB, ImageLayout, MiB, build_image, mutate_image  # noqa: E402
from gpusnap.storage import CheckpointStore, generate_signing_key, open_store  # noqa: E402
from gpusnap.storage.backend import BackendOptions  # noqa: E402
from gpusnap.storage.confirm import ChunkProof, refresh_identity  # noqa: E402
from tests.support.moto_server import MotoServer  # noqa: E402

TARGETS = {
    "push_vs_compression": 0.8,  # push MB/s >= 0.8x zstd -T0 -1 alone
    "incremental_bytes": 0.10,  # incremental uploads <= 10% of the first push's bytes
    "incremental_time": 0.30,  # ... in <= 30% of its time
    "pull_vs_decompression": 0.8,  # pull MB/s >= 0.8x zstd -d alone
    "proof_vs_incremental": 0.05,  # the proof alone <= 5% of the incremental push it guards
}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def sh(cmd: str) -> float:
    """Run a shell pipeline; its wall time in seconds."""
    t0 = time.perf_counter()
    subprocess.run(["bash", "-o", "pipefail", "-c", cmd], check=True)
    return time.perf_counter() - t0


def files_of(root: Path, layout: ImageLayout) -> list[Path]:
    return [root / rel for rel in layout.files]


def quoted(paths: list[Path]) -> str:
    return " ".join(f"'{p}'" for p in paths)


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    zstd_version = subprocess.run(
        ["zstd", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(mem / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "zstd": zstd_version,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def measure_proof(store: CheckpointStore, checkpoint_id: str) -> dict[str, Any]:
    """The proof of an incremental push, run alone on that push's chunks (best of 3): the
    identity read it starts with, then HEADs or a LIST, as the push would choose."""
    ids = store.manifest(checkpoint_id).chunk_ids()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        refresh_identity(store.context)
        proof = ChunkProof(store.context)
        missing = proof.missing(ids)
        runs.append(time.perf_counter() - t0)
        assert not missing, f"{len(missing)} chunks of {checkpoint_id} missing"
    return {"seconds": min(runs), "runs": runs, "chunks": len(ids), "method": proof.stats.method}


def bench_file_store(work: Path, size: int, seed: int, workers: int | None) -> dict[str, Any]:
    image = work / "image"
    t_build, layout = timed(lambda: build_image(image, size, seed=seed))
    total = layout.total
    print(f"built {total / GiB:.2f} GiB image in {t_build:.1f} s", file=sys.stderr)
    files = files_of(image, layout)
    key = work / "signing.key"
    generate_signing_key(key)
    res: dict[str, Any] = {"bytes": total, "files": {k: v for k, v in layout.files.items()}}
    res["load_average_before"] = os.getloadavg()

    # Baselines first on the same warm bytes: compression alone, then disk alone.
    res["zstd_compress_s"] = sh(f"zstd -q -T0 -1 -c {quoted(files)} > /dev/null")
    zst = work / "all.zst"
    res["zstd_compress_to_file_s"] = sh(f"zstd -q -T0 -1 -c {quoted(files)} > '{zst}' && sync")
    res["zstd_ratio"] = total / zst.stat().st_size
    copy = work / "copy"
    res["copy_s"] = sh(f"cp -r '{image}' '{copy}' && sync")
    shutil.rmtree(copy)

    # (a) first push to a fresh store.
    store_dir = work / "store"
    store = open_store(
        f"file://{store_dir}", key_file=key, cache_dir=work / "cache", workers=workers
    )
    try:
        res["push_s"], first = timed(lambda: store.push(image, workload="bench"))
        res["push"] = first.as_dict()
        print(f"push: {res['push_s']:.1f} s", file=sys.stderr)

        # (b) incremental push after a small change.
        change = mutate_image(image, layout)
        res["change"] = {"rewritten": change.bytes_rewritten, "inserted": change.bytes_inserted}
        res["incremental_s"], second = timed(
            lambda: store.push(image, workload="bench", parent=first.checkpoint_id)
        )
        res["incremental"] = second.as_dict()
        print(f"incremental push: {res['incremental_s']:.1f} s", file=sys.stderr)
        res["proof_alone"] = measure_proof(store, second.checkpoint_id)

        # (c) pull of the second checkpoint (the image as it is now) vs zstd -d.
        pulled = work / "pulled"
        res["pull_s"], pull = timed(lambda: store.pull(second.checkpoint_id, pulled))
        res["pull"] = pull.as_dict()
        print(f"pull: {res['pull_s']:.1f} s", file=sys.stderr)
        _same, mismatch, errors = filecmp.cmpfiles(image, pulled, list(layout.files), shallow=False)
        res["pull_identical"] = not mismatch and not errors
    finally:
        store.close()
    res["zstd_decompress_s"] = sh(f"zstd -q -d -c '{zst}' > /dev/null")
    res["zstd_decompress_to_file_s"] = sh(f"zstd -q -d -c '{zst}' > '{work / 'unz.bin'}' && sync")
    res["store_bytes_on_disk"] = sum(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
    res["load_average_after"] = os.getloadavg()
    return res


def bench_s3(work: Path, size: int, seed: int) -> dict[str, Any]:
    image = work / "s3-image"
    layout = build_image(image, size, seed=seed + 10)
    files = files_of(image, layout)
    key = work / "signing.key"
    if not key.exists():
        generate_signing_key(key)
    res: dict[str, Any] = {"bytes": layout.total}
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with MotoServer() as server:
        endpoint = server.endpoint_url
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="baseline")
        s3.create_bucket(Bucket="store")

        def upload_all() -> None:
            for f in files:
                s3.upload_file(str(f), "baseline", f.relative_to(image).as_posix())

        res["boto3_upload_s"], _ = timed(upload_all)
        print(f"boto3 upload: {res['boto3_upload_s']:.1f} s", file=sys.stderr)
        options = BackendOptions(endpoint_url=endpoint, region="us-east-1", addressing_style="path")
        store = open_store(
            "s3://store/bench", key_file=key, options=options, cache_dir=work / "s3-cache"
        )
        try:
            res["push_s"], pushed = timed(lambda: store.push(image, workload="bench-s3"))
            res["push"] = pushed.as_dict()
            mutate_image(image, layout)
            res["incremental_s"], second = timed(
                lambda: store.push(image, workload="bench-s3", parent=pushed.checkpoint_id)
            )
            res["incremental"] = second.as_dict()
            res["proof_alone"] = measure_proof(store, second.checkpoint_id)
        finally:
            store.close()
        print(f"s3 push: {res['push_s']:.1f} s", file=sys.stderr)
    return res


def summarize(f: dict[str, Any], s3: dict[str, Any] | None) -> dict[str, Any]:
    total = f["bytes"]
    push_mbps = mbps(total, f["push_s"])
    comp_mbps = mbps(total, f["zstd_compress_s"])
    pull_mbps = mbps(total, f["pull_s"])
    dec_mbps = mbps(total, f["zstd_decompress_s"])
    first_up = f["push"]["bytes_uploaded"]
    inc_up = f["incremental"]["bytes_uploaded"]
    ratios: dict[str, float] = {
        "push_vs_compression": push_mbps / comp_mbps,
        "push_vs_copy": push_mbps / mbps(total, f["copy_s"]),
        "incremental_bytes": inc_up / first_up if first_up else float("inf"),
        "incremental_time": f["incremental_s"] / f["push_s"],
        "pull_vs_decompression": pull_mbps / dec_mbps,
        "pull_vs_decompression_to_file": pull_mbps / mbps(total, f["zstd_decompress_to_file_s"]),
        "proof_vs_incremental": f["proof_alone"]["seconds"] / f["incremental_s"],
        "proof_wait_vs_incremental": f["incremental"]["proof_seconds"] / f["incremental_s"],
    }
    if s3 is not None:
        ratios["s3_push_time_vs_boto3_upload"] = s3["push_s"] / s3["boto3_upload_s"]
        ratios["s3_proof_vs_incremental"] = s3["proof_alone"]["seconds"] / s3["incremental_s"]
        ratios["s3_proof_wait_vs_incremental"] = (
            s3["incremental"]["proof_seconds"] / s3["incremental_s"]
        )
    return {
        "throughput_mbps": {
            "push": push_mbps,
            "zstd_T0_1": comp_mbps,
            "copy_sync": mbps(total, f["copy_s"]),
            "pull": pull_mbps,
            "zstd_d": dec_mbps,
            "zstd_d_to_file": mbps(total, f["zstd_decompress_to_file_s"]),
        },
        "ratios": ratios,
        "targets": TARGETS,
        "met": judge(ratios),
    }


def judge(ratios: dict[str, float]) -> dict[str, bool]:
    """Each target against ``ratios`` (one round's, or the medians over rounds)."""
    return {
        "push_vs_compression": ratios["push_vs_compression"] >= TARGETS["push_vs_compression"],
        "incremental_bytes": ratios["incremental_bytes"] <= TARGETS["incremental_bytes"],
        "incremental_time": ratios["incremental_time"] <= TARGETS["incremental_time"],
        "pull_vs_decompression": ratios["pull_vs_decompression"]
        >= TARGETS["pull_vs_decompression"],
        "proof_vs_incremental": ratios["proof_vs_incremental"] <= TARGETS["proof_vs_incremental"],
    }


def print_table(f: dict[str, Any], s3: dict[str, Any] | None, summary: dict[str, Any]) -> None:
    total = f["bytes"]
    t = summary["throughput_mbps"]
    r = summary["ratios"]
    met = summary["met"]

    def mark(name: str) -> str:
        return "met" if met[name] else "NOT MET"

    push, inc = f["push"], f["incremental"]
    push_note = (
        f"{r['push_vs_compression']:.2f}x zstd (target >= 0.8: {mark('push_vs_compression')});"
        f" {r['push_vs_copy']:.2f}x cp"
    )
    pull_note = (
        f"{r['pull_vs_decompression']:.2f}x zstd -d (the target's baseline, >= 0.8: "
        f"{mark('pull_vs_decompression')}); {r['pull_vs_decompression_to_file']:.2f}x zstd -d"
        f" to a file + sync; identical: {f['pull_identical']}"
    )
    rows = [
        ("image", f"{total / GiB:.2f} GiB", "", ""),
        (
            "zstd -T0 -1 (compression alone)",
            f"{f['zstd_compress_s']:.2f} s",
            f"{t['zstd_T0_1']:.0f} MB/s",
            f"ratio {f['zstd_ratio']:.2f}x",
        ),
        ("cp + sync (disk alone)", f"{f['copy_s']:.2f} s", f"{t['copy_sync']:.0f} MB/s", ""),
        ("push, file://", f"{f['push_s']:.2f} s", f"{t['push']:.0f} MB/s", push_note),
        (
            "  uploaded",
            f"{push['bytes_uploaded'] / MiB:.0f} MiB",
            f"{push['chunks_uploaded']} chunks",
            f"store on disk {f['store_bytes_on_disk'] / MiB:.0f} MiB",
        ),
        (
            "incremental push",
            f"{f['incremental_s']:.2f} s",
            f"{r['incremental_time'] * 100:.1f}% of time",
            f"target <= 30%: {mark('incremental_time')}",
        ),
        (
            "  uploaded",
            f"{inc['bytes_uploaded'] / MiB:.1f} MiB",
            f"{r['incremental_bytes'] * 100:.1f}% of bytes",
            f"target <= 10%: {mark('incremental_bytes')}",
        ),
        (
            "zstd -d > /dev/null (decompression alone)",
            f"{f['zstd_decompress_s']:.2f} s",
            f"{t['zstd_d']:.0f} MB/s",
            "the baseline of the pull target",
        ),
        (
            "zstd -d > file + sync (like for like)",
            f"{f['zstd_decompress_to_file_s']:.2f} s",
            f"{t['zstd_d_to_file']:.0f} MB/s",
            "same filesystem as the pull",
        ),
        ("pull, file://", f"{f['pull_s']:.2f} s", f"{t['pull']:.0f} MB/s", pull_note),
        (
            "  proof of the incremental push",
            f"{f['proof_alone']['seconds'] * 1000:.1f} ms alone",
            f"{r['proof_vs_incremental'] * 100:.1f}% of it",
            f"target <= 5%: {mark('proof_vs_incremental')}; the push waited "
            f"{f['incremental']['proof_seconds'] * 1000:.1f} ms "
            f"({r['proof_wait_vs_incremental'] * 100:.1f}%); "
            f"{f['proof_alone']['chunks']} chunks by {f['proof_alone']['method']}",
        ),
    ]
    if s3 is not None:
        s3_note = (
            f"{r['s3_push_time_vs_boto3_upload']:.2f}x the boto3 time;"
            f" uploaded {s3['push']['bytes_uploaded'] / MiB:.0f} MiB"
        )
        rows += [
            ("S3 image (moto)", f"{s3['bytes'] / MiB:.0f} MiB", "", ""),
            (
                "boto3 upload_file (default)",
                f"{s3['boto3_upload_s']:.2f} s",
                f"{mbps(s3['bytes'], s3['boto3_upload_s']):.0f} MB/s",
                "",
            ),
            (
                "push, s3:// (moto)",
                f"{s3['push_s']:.2f} s",
                f"{mbps(s3['bytes'], s3['push_s']):.0f} MB/s",
                s3_note,
            ),
            (
                "incremental push, s3:// (moto)",
                f"{s3['incremental_s']:.2f} s",
                f"proof alone {s3['proof_alone']['seconds'] * 1000:.1f} ms",
                f"{r['s3_proof_vs_incremental'] * 100:.1f}% of it; the push waited "
                f"{s3['incremental']['proof_seconds'] * 1000:.1f} ms "
                f"({r['s3_proof_wait_vs_incremental'] * 100:.1f}%); "
                f"{s3['proof_alone']['chunks']} chunks by {s3['proof_alone']['method']}",
            ),
        ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0, help="image size (default 2)")
    ap.add_argument("--s3-size-mib", type=int, default=256, help="image size for the S3 part")
    ap.add_argument("--skip-s3", action="store_true", help="leave out the moto part")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the file:// part")
    ap.add_argument("--workers", type=int, help="store CPU workers (default: CPU count)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"), help="scratch parent")
    ap.add_argument("--json-out", type=Path, help="also write the JSON object here")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if shutil.which("zstd") is None:
        print("store_bench: the zstd command is needed (apt-get install zstd)", file=sys.stderr)
        return 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpusnap-bench-", dir=args.workdir))
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    try:
        for i in range(max(1, args.repeat)):
            round_dir = work / f"round-{i + 1}"
            round_dir.mkdir()
            rounds.append(
                bench_file_store(round_dir, int(args.size_gib * GiB), args.seed, args.workers)
            )
            if not args.keep:
                shutil.rmtree(round_dir, ignore_errors=True)
        s3 = None if args.skip_s3 else bench_s3(work, args.s3_size_mib * MiB, args.seed)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summaries = [summarize(f, s3 if i == 0 else None) for i, f in enumerate(rounds)]
    ratio_names = list(summaries[0]["ratios"])
    medians = {
        name: median([s["ratios"][name] for s in summaries if name in s["ratios"]])
        for name in ratio_names
    }
    result = {
        # The box may be shared: a high load average means the figures are noisy.
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "machine": machine(),
        "workers": args.workers,
        "note": "warm reads: the image was just written; page cache not dropped",
        "file_store": rounds[0],
        "file_store_rounds": rounds,
        "s3_moto": s3,
        **summaries[0],
        "rounds": [s["ratios"] for s in summaries],
        "ratios_median": medians,
        "met_median": judge(medians),
        # Per target: in how many rounds it was met.
        "rounds_met": {
            name: sum(1 for s in summaries if s["met"][name]) for name in summaries[0]["met"]
        },
    }
    for i, (f, summary) in enumerate(zip(rounds, summaries, strict=True)):
        load = f["load_average_before"][0], f["load_average_after"][0]
        print(f"round {i + 1} of {len(rounds)} (load average {load[0]:.2f} -> {load[1]:.2f}):")
        print_table(f, s3 if i == 0 else None, summary)
        print()
    if len(rounds) > 1:
        print("median over rounds: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
        print(
            "targets: "
            + ", ".join(
                f"{k} {'met' if ok else 'NOT MET'} on the median, in "
                f"{result['rounds_met'][k]} of {len(rounds)} rounds"
                for k, ok in result["met_median"].items()
            )
        )
    before, after = result["load_average_1_5_15"]["before"], result["load_average_1_5_15"]["after"]
    print(f"load average (1 min): {before[0]:.2f} before, {after[0]:.2f} after")
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
