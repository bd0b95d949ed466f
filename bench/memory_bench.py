"""Memory benchmark: peak anonymous memory of push, pull and the cache, at a small and a large
image, to show it does not grow with the checkpoint (issue 14 §3: 16 GiB within 1.5x 1 GiB).

    .venv/bin/python bench/memory_bench.py [--small-gib 1] [--large-gib 16] [--rounds 1]
                                           [--workdir /var/tmp] [--json-out FILE]

Each operation runs in a process of its own, and the bench samples that process's ``RssAnon``
(``/proc/PID/status``: heap, thread stacks, anonymous maps; not the page cache or mapped
files) every 2 ms and keeps the peak. The operations, on the same image of each size:

- ``push``: ``gpusnap store push`` of the image to a fresh ``file://`` store (the CLI);
- ``pull``: ``gpusnap store pull --no-cache`` of it into an empty directory;
- ``pull_fill``: ``gpusnap store pull`` through an empty chunk cache (every chunk kept);
- ``pull_cached``: the same pull through that cache, now warm (every chunk from it);
- ``stream_push``: ``CheckpointStore.upload_streams`` of a generated stream of the image's
  size, then the push that names it: the daemon's GPU memory path (custom storage);
- ``stream_read``: ``CheckpointStore.open_stream`` of that stream read to the end: the
  restore's GPU refill;
- ``growing_push``: ``CheckpointStore.upload_growing`` of the image's largest file: the
  daemon's page images uploaded while CRIU writes them.

The daemon's checkpoint and restore run exactly these store calls (push of the CRIU images,
``upload_growing``, ``upload_streams``; pull of the images, ``open_stream``) in the daemon's
process; the daemon itself holds one manifest per workload besides.

The image is generated, sparse: every 32 MiB holds 8 MiB of random bytes (unique chunks,
incompressible: the costliest for memory, every object a full copy) and 24 MiB of holes,
which read as zeros and chunk into the all-zero maximum chunk, as an engine's unused KV pool
does. So a 16 GiB image takes 4 GiB of disk, its store 4 GiB, a pull 4 GiB. The stream
carries the same pattern. Ratios (large / small, same round) are the figures; the target is
each at most 1.5. Prints a table per round and one JSON object (``--json-out`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.store_bench import machine  # noqa: E402

MiB = 1024 * 1024
GiB = 1024 * MiB
PIECE = 32 * MiB
DATA = 8 * MiB  # of each piece; the rest is a hole
TARGET = 1.5
OPS = (
    "push",
    "pull",
    "pull_fill",
    "pull_cached",
    "stream_push",
    "stream_read",
    "growing_push",
)
GPUSNAP = [sys.executable, "-m", "gpusnap.cli.main"]


def piece(index: int) -> bytes:
    """The data part of piece ``index``: random, the same for every run."""
    import numpy as np  # noqa: PLC0415 - only the generating processes need it

    return np.random.default_rng(index).bytes(DATA)


def build_image(dest: Path, size: int) -> None:
    """``size`` bytes in two files (``host/pages-1.img``: 1/16, ``gpu/device-0.bin``: the
    rest), each 32 MiB of them 8 MiB of data then a hole."""
    host = size // 16 // PIECE * PIECE
    files = {"host/pages-1.img": host, "gpu/device-0.bin": size - host}
    at = 0
    for rel, n in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for offset in range(0, n, PIECE):
                f.seek(offset)
                f.write(piece(at)[: min(DATA, n - offset)])
                at += 1
            f.truncate(n)


def stream_buffers(size: int) -> Iterator[bytes]:
    zeros = bytes(PIECE - DATA)
    done = 0
    index = 0
    while done < size:
        for part in (piece(10_000 + index), zeros):
            take = part[: size - done]
            if take:
                yield take
                done += len(take)
        index += 1


# --- the child processes of the stream and growing operations ---------------------------


def child(mode: str, url: str, key: Path, index: Path, size: int, arg: str) -> None:
    from gpusnap.storage import open_store  # noqa: PLC0415
    from gpusnap.storage.streams import StreamSource  # noqa: PLC0415

    with open_store(url, key_file=key, cache_dir=index) as store:
        if mode == "stream_push":
            up = store.upload_streams({"gpu/0.bin": StreamSource(size, stream_buffers(size))})
            empty = Path(tempfile.mkdtemp())
            print(store.push(empty, workload="stream", uploaded_streams=up).checkpoint_id)
            empty.rmdir()
        elif mode == "stream_read":
            seen = 0
            for _offset, data in store.open_stream(arg, "gpu/0.bin"):
                seen += len(data)
            assert seen == size, (seen, size)
        elif mode == "growing_push":
            path = Path(arg)
            up = store.upload_growing(path, path.name, complete=lambda: True)
            assert up.bytes_total == path.stat().st_size
        else:
            raise SystemExit(f"unknown child mode {mode}")


# --- sampling ---------------------------------------------------------------------------


def rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measured(argv: list[str]) -> dict[str, Any]:
    """Run ``argv``; its peak RssAnon (sampled every 2 ms), seconds, and its stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    samples = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak, samples
        while not stop.is_set():
            value = rss_anon(proc.pid)
            if value is not None:
                peak = max(peak, value)
                samples += 1
            stop.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {err}")
    return {
        "peak_rss_anon": peak,
        "seconds": round(time.perf_counter() - t0, 3),
        "samples": samples,
        "stdout": out,
    }


def one_size(work: Path, key: Path, size: int, ops: tuple[str, ...]) -> dict[str, Any]:
    image = work / "image"
    build_image(image, size)
    url = f"file://{work / 'store'}"
    store = ["--store", url, "--key-file", str(key)]
    res: dict[str, Any] = {"bytes": size}
    index = ["--cache-dir", str(work / "idx")]
    push = measured(
        [*GPUSNAP, "store", "push", *store, *index, "--workload", "w", "--json", str(image)]
    )
    checkpoint = json.loads(push.pop("stdout"))["checkpoint_id"]
    res["push"] = push

    def pull(name: str, *cache: str) -> None:
        dest = work / "dest"
        got = measured([*GPUSNAP, "store", "pull", *store, *cache, "--json", checkpoint, str(dest)])
        got["from_cache"] = json.loads(got.pop("stdout")).get("bytes_cached", 0)
        res[name] = got
        shutil.rmtree(dest)

    if "pull" in ops:
        pull("pull", "--cache-dir", str(work / "idx"), "--no-cache")
    if {"pull_fill", "pull_cached"} & set(ops):
        pull("pull_fill", "--cache-dir", str(work / "node-cache"))
        pull("pull_cached", "--cache-dir", str(work / "node-cache"))
        shutil.rmtree(work / "node-cache")

    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    common = [url, str(key), str(work / "idx-s"), str(size)]
    if {"stream_push", "stream_read"} & set(ops):
        sp = measured([*me, "stream_push", *common, "-"])
        stream_id = sp.pop("stdout").strip()
        res["stream_push"] = sp
        res["stream_read"] = measured([*me, "stream_read", *common, stream_id])
        res["stream_read"].pop("stdout")
    if "growing_push" in ops:
        largest = image / "gpu" / "device-0.bin"
        res["growing_push"] = measured([*me, "growing_push", *common, str(largest)])
        res["growing_push"].pop("stdout")
    shutil.rmtree(image)
    shutil.rmtree(work / "store")
    for d in ("idx", "idx-s"):
        shutil.rmtree(work / d, ignore_errors=True)
    return res


def one_round(
    base: Path, key: Path, small: int, large: int, ops: tuple[str, ...]
) -> dict[str, Any]:
    out: dict[str, Any] = {"load_average_before": os.getloadavg()}
    for name, size in (("small", small), ("large", large)):
        work = base / name
        work.mkdir()
        try:
            out[name] = one_size(work, key, size, ops)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    out["ratios"] = {
        op: round(out["large"][op]["peak_rss_anon"] / out["small"][op]["peak_rss_anon"], 3)
        for op in ops
    }
    return out


def table(r: dict[str, Any], small: int, large: int, ops: tuple[str, ...]) -> str:
    rows = [f"{'operation':<14} {small / GiB:>6.0f} GiB  {large / GiB:>6.0f} GiB   ratio  target"]
    for op in ops:
        a = r["small"][op]["peak_rss_anon"] / MiB
        b = r["large"][op]["peak_rss_anon"] / MiB
        ratio = r["ratios"][op]
        mark = "met" if ratio <= TARGET else "MISSED"
        rows.append(f"{op:<14} {a:>6.1f} MiB {b:>6.1f} MiB  {ratio:>5.2f}  <= {TARGET} {mark}")
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, url, key, index, size, arg = sys.argv[2:8]
        child(mode, url, Path(key), Path(index), int(size), arg)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small-gib", type=float, default=1.0)
    p.add_argument("--large-gib", type=float, default=16.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json-out", type=Path)
    p.add_argument("--ops", help="only these operations, comma-separated (default: all)")
    args = p.parse_args()
    ops = tuple(op for op in OPS if not args.ops or op in args.ops.split(","))
    small = int(args.small_gib * GiB) // PIECE * PIECE
    large = int(args.large_gib * GiB) // PIECE * PIECE
    from gpusnap.storage import generate_signing_key  # noqa: PLC0415

    base = Path(tempfile.mkdtemp(prefix="gpusnap-membench-", dir=args.workdir))
    try:
        key = base / "signing.key"
        generate_signing_key(key)
        rounds = []
        for i in range(args.rounds):
            work = base / f"round-{i}"
            work.mkdir()
            r = one_round(work, key, small, large, ops)
            rounds.append(r)
            print(f"round {i + 1}:\n{table(r, small, large, ops)}\n", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    medians = {op: statistics.median(r["ratios"][op] for r in rounds) for op in ops}
    doc = {
        "machine": machine(),
        "small_bytes": small,
        "large_bytes": large,
        "target_ratio": TARGET,
        "rounds": rounds,
        "median_ratios": medians,
        "met_median": {op: medians[op] <= TARGET for op in ops},
        "rounds_met": {op: sum(r["ratios"][op] <= TARGET for r in rounds) for op in ops},
    }
    if args.json_out:  # first: a reader of stdout that stops early must not lose it
        args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
