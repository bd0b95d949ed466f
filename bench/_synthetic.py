"""A synthetic GPU-like checkpoint image, and the small change an incremental checkpoint sees.

The image mixes what a serving process's checkpoint holds, in the proportions the benchmark
asks for (by bytes):

- ~50% model weights: bf16-like values (float32 standard normal, top 16 bits kept), which zstd
  level 1 compresses about 1.29x (only the exponent byte has entropy to remove);
- ~40% a KV-cache pool of 64 KiB blocks, ~20% of them filled with bf16-like data, the rest zero;
- ~10% random bytes (host pages, already-compressed data), incompressible;
- a few small metadata files, as CRIU writes next to its page images.

Everything is seeded, so two runs build the same bytes. Memory stays bounded: data is made
and written in 32 MiB pieces.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MiB = 1024 * 1024
GiB = 1024 * MiB
PAGE = 4096
KV_BLOCK = 64 * 1024
_PIECE = 32 * MiB


def bf16_like(rng: np.random.Generator, nbytes: int) -> bytes:
    """``nbytes`` (even) of bf16-like weights: the top half of float32 normals."""
    values = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def random_bytes(rng: np.random.Generator, nbytes: int) -> bytes:
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _kv_piece(rng: np.random.Generator, nbytes: int, fill: float) -> bytes:
    blocks = nbytes // KV_BLOCK
    out = np.zeros(blocks * KV_BLOCK, dtype=np.uint8)
    filled = np.flatnonzero(rng.random(blocks) < fill)
    if filled.size:
        data = np.frombuffer(bf16_like(rng, filled.size * KV_BLOCK), dtype=np.uint8)
        view = out.reshape(blocks, KV_BLOCK)
        view[filled] = data.reshape(filled.size, KV_BLOCK)
    return out.tobytes()


def _write(path: Path, size: int, make: Callable[[int], bytes]) -> None:
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(_PIECE, left)
            f.write(make(n))
            left -= n


@dataclass(frozen=True)
class ImageLayout:
    files: dict[str, int]  # relative path -> size in bytes

    @property
    def total(self) -> int:
        return sum(self.files.values())


def build_image(dest: Path, total_bytes: int, *, seed: int = 1) -> ImageLayout:
    """Write a GPU-like image of about ``total_bytes`` into ``dest`` (created if missing)."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def align(n: int, unit: int) -> int:
        return max(unit, n // unit * unit)

    weights = align(total_bytes // 2, 2 * MiB)
    kv = align(total_bytes * 4 // 10, KV_BLOCK)
    small = {"core-1.img": 6 * 1024, "mm-1.img": 48 * 1024, "files.img": 12 * 1024}
    rand = align(total_bytes - weights - kv - sum(small.values()), PAGE)
    layout = {
        "gpu/weights-00001-of-00002.bin": align(weights // 2, 2 * MiB),
        "gpu/weights-00002-of-00002.bin": weights - align(weights // 2, 2 * MiB),
        "gpu/kv-pool.bin": kv,
        "host/pages-1.img": rand,
        **{f"host/{name}": size for name, size in small.items()},
    }
    for rel, size in layout.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("gpu/weights"):
            _write(path, size, lambda n: bf16_like(rng, n))
        elif rel == "gpu/kv-pool.bin":
            _write(path, size, lambda n: _kv_piece(rng, n, 0.2))
        else:
            _write(path, size, lambda n: random_bytes(rng, n))
    return ImageLayout({k: v for k, v in layout.items() if v > 0})


@dataclass(frozen=True)
class Change:
    bytes_rewritten: int
    bytes_inserted: int


def mutate_image(
    root: Path,
    layout: ImageLayout,
    *,
    fraction: float = 0.05,
    regions: int = 4,
    inserted_pages: int = 3,
    seed: int = 2,
) -> Change:
    """What changes between two checkpoints of a serving process.

    ``regions`` contiguous regions totalling ``fraction`` of all bytes are overwritten (KV
    blocks and host pages being rewritten), then ``inserted_pages`` 4 KiB pages are inserted
    near the start of the host page image (a new mapping shifts everything after it).
    """
    rng = np.random.default_rng(seed)
    big = [rel for rel, size in layout.files.items() if size >= 16 * MiB]
    per_region = int(layout.total * fraction) // regions // PAGE * PAGE
    rewritten = 0
    for i in range(regions):
        rel = big[i % len(big)]
        size = layout.files[rel]
        length = min(per_region, size // 2)
        offset = int(rng.integers(0, (size - length) // PAGE + 1)) * PAGE
        with open(root / rel, "r+b") as f:
            f.seek(offset)
            left = length
            while left > 0:
                n = min(_PIECE, left)
                f.write(bf16_like(rng, n))
                left -= n
        rewritten += length
    pages_file = root / "host/pages-1.img"
    data = pages_file.read_bytes()
    at = 16 * PAGE
    inserted = random_bytes(rng, inserted_pages * PAGE)
    tmp = pages_file.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data[:at])
        f.write(inserted)
        f.write(data[at:])
    os.replace(tmp, pages_file)
    return Change(bytes_rewritten=rewritten, bytes_inserted=len(inserted))
