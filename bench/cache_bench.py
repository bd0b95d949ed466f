"""Chunk cache benchmark: a pull through the node's cache against a pull from a file:// store.

    .venv/bin/python bench/cache_bench.py [--size-gib 1] [--repeat 3] [--workers W]
                                          [--workdir /var/tmp] [--json-out FILE]

Builds the synthetic GPU-like image (bench/_synthetic.py), pushes it to a file:// store, and
measures in each round, on the same checkpoint, into a fresh destination each time:

a) ``store``: a pull with no cache (every chunk read from the store; the baseline);
b) ``fill``: a pull through an empty cache (every chunk from the store, and kept);
c) ``cached``: a pull through that now warm cache (every chunk from the cache);
d) ``prefetch``: a prefetch of the checkpoint into another empty cache (no bandwidth cap).

Ratios (same round): ``cached_vs_store`` = time(a) / time(c) (above 1: the cache's read path
is faster than the store's), ``fill_overhead`` = time(b) / time(a) (what keeping the chunks
costs a cold pull). Then, once: 5% of the image changes (``mutate_image``: 4 regions and 3
inserted pages), the new checkpoint is pushed, and it is pulled through the cache warmed by
the first one against a pull from the store alone: bytes fetched from the store and time.

A file:// store on the same disk is the hardest baseline for a cache: its reads cost what
the cache's do (a local file each). Against a remote store the cache saves the network; that
(and the warm-vs-cold standby restore, which needs the daemon) is measured elsewhere.
Everything is warm in the page cache (the image and store were just written). Prints a table
per round, then one JSON object with every figure (``--json-out`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._synthetic import GiB, MiB, build_image, mutate_image  # noqa: E402
from bench.store_bench import machine  # noqa: E402
from gpusnap.storage import ChunkCache, generate_signing_key, open_store  # noqa: E402
from gpusnap.storage.store import CheckpointStore  # noqa: E402


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def pull_into(store: CheckpointStore, checkpoint: str, dest: Path) -> tuple[float, Any]:
    seconds, result = timed(lambda: store.pull(checkpoint, dest))
    shutil.rmtree(dest)
    return seconds, result


def one_round(
    work: Path, url: str, key: Path, checkpoint: str, size: int, workers: int | None
) -> dict[str, Any]:
    res: dict[str, Any] = {"load_average_before": os.getloadavg()}

    def opened(cache: ChunkCache | None, index: str) -> CheckpointStore:
        return open_store(
            url, key_file=key, cache_dir=work / index, workers=workers, chunk_cache=cache
        )

    with opened(None, "index-plain") as store:
        res["store_s"], pulled = pull_into(store, checkpoint, work / "dest")
        res["store_fetched"] = pulled.bytes_fetched
    cache_dir = work / "node-cache"
    with (
        ChunkCache(cache_dir, max_bytes=2 * size + GiB) as cache,
        opened(cache, "index-c") as store,
    ):
        res["fill_s"], filled = pull_into(store, checkpoint, work / "dest")
        res["cached_s"], cached = pull_into(store, checkpoint, work / "dest")
        res["fill_fetched"], res["cached_cached"] = filled.bytes_fetched, cached.bytes_cached
        res["cached_fetched"] = cached.bytes_fetched
    shutil.rmtree(cache_dir)
    with (
        ChunkCache(cache_dir, max_bytes=2 * size + GiB) as cache,
        opened(cache, "index-c") as store,
    ):
        res["prefetch_s"], warmed = timed(lambda: store.prefetch(checkpoint, threads=2))
        res["prefetch_warm_fraction"] = warmed.warm_fraction
    shutil.rmtree(cache_dir)
    res["cached_vs_store"] = res["store_s"] / res["cached_s"]
    res["fill_overhead"] = res["fill_s"] / res["store_s"]
    return res


def delta_round(
    work: Path, url: str, key: Path, image: Path, parent: str, size: int, layout: Any
) -> dict[str, Any]:
    change = mutate_image(image, layout)
    res: dict[str, Any] = {"bytes_rewritten": change.bytes_rewritten}
    with open_store(url, key_file=key, cache_dir=work / "index-plain") as store:
        child = store.push(image, workload="bench", parent=parent).checkpoint_id
        res["cold_s"], cold = pull_into(store, child, work / "dest")
    cache_dir = work / "node-cache"
    with (
        ChunkCache(cache_dir, max_bytes=2 * size + GiB) as cache,
        open_store(url, key_file=key, cache_dir=work / "index-c", chunk_cache=cache) as store,
    ):
        store.prefetch(parent, threads=2)  # a standby that followed the parent
        res["warm_fraction_before"] = store.warm_fraction(child)
        res["warm_s"], warm = pull_into(store, child, work / "dest")
    shutil.rmtree(cache_dir)
    res["bytes_total"] = warm.bytes_total
    res["cold_fetched"], res["warm_fetched"] = cold.bytes_fetched, warm.bytes_fetched
    res["fetched_fraction"] = warm.bytes_fetched / warm.bytes_total
    res["warm_vs_cold_time"] = res["warm_s"] / res["cold_s"]
    return res


def print_round(i: int, r: dict[str, Any], size: int) -> None:
    def row(name: str, seconds: float, note: str = "") -> None:
        print(f"  {name:<10} {seconds:7.2f} s  {size / seconds / 1e6:8.0f} MB/s  {note}")

    print(f"round {i + 1} (load {r['load_average_before'][0]:.2f})")
    row("store", r["store_s"], f"fetched {r['store_fetched'] / MiB:.0f} MiB")
    row("fill", r["fill_s"], f"x{r['fill_overhead']:.2f} of store")
    row("cached", r["cached_s"], f"x{r['cached_vs_store']:.2f} faster than store")
    row("prefetch", r["prefetch_s"], f"warm {r['prefetch_warm_fraction']:.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpusnap-cache-bench-", dir=args.workdir))
    try:
        image = work / "image"
        layout = build_image(image, int(args.size_gib * GiB), seed=1)
        size = layout.total
        key = work / "signing.key"
        generate_signing_key(key)
        url = f"file://{work / 'store'}"
        with open_store(url, key_file=key, cache_dir=work / "index-plain") as store:
            checkpoint = store.push(image, workload="bench").checkpoint_id
        rounds = []
        for i in range(args.repeat):
            r = one_round(work, url, key, checkpoint, size, args.workers)
            print_round(i, r, size)
            rounds.append(r)
        delta = delta_round(work, url, key, image, checkpoint, size, layout)
        print(
            f"after a 5% change: warm {delta['warm_fraction_before']:.0%} before the pull; "
            f"fetched {delta['fetched_fraction']:.1%} of the image "
            f"({delta['warm_fetched'] / MiB:.0f} of {delta['cold_fetched'] / MiB:.0f} MiB), "
            f"time x{delta['warm_vs_cold_time']:.2f} of a pull from the store alone"
        )
        summary = {
            "cached_vs_store_median": statistics.median(r["cached_vs_store"] for r in rounds),
            "fill_overhead_median": statistics.median(r["fill_overhead"] for r in rounds),
        }
        print(
            f"median: cached pull x{summary['cached_vs_store_median']:.2f} the speed of a "
            "file:// pull; a pull that fills the cache takes "
            f"x{summary['fill_overhead_median']:.2f}"
        )
        out = {
            "machine": machine(),
            "bytes": size,
            "rounds": rounds,
            "delta": delta,
            "summary": summary,
        }
        print(json.dumps(out, default=str))
        if args.json_out:
            args.json_out.write_text(json.dumps(out, indent=2, default=str))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
