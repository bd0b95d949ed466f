"""Helpers shared by the checkpoint-store tests: keys, source trees, stores on a directory,
backend options for tests, and the store a parametrized test runs against."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpusnap.storage import (
    BackendOptions,
    CheckpointStore,
    PushResult,
    generate_signing_key,
    open_store,
)
from gpusnap.storage.backend import Backend
from gpusnap.storage.keys import generate_encryption_key, seal
from gpusnap.storage.layout import manifest_key
from gpusnap.storage.manifest import ENVELOPE_FORMAT
from tests.support.moto_server import TEST_REGION, MotoServer

MiB = 1024 * 1024

# Small enough that a 12 MiB object goes up in three real parts (S3's floor is 5 MiB).
MULTIPART_THRESHOLD = 5 * 1024 * 1024 + 1
MULTIPART_CHUNKSIZE = 5 * 1024 * 1024


def fast_options(endpoint_url: str | None = None, **overrides: Any) -> BackendOptions:
    """Options with small multipart sizes and fast retries, for every storage test."""
    values: dict[str, Any] = {
        "endpoint_url": endpoint_url,
        "region": TEST_REGION,
        "addressing_style": "path",
        "multipart_threshold": MULTIPART_THRESHOLD,
        "multipart_chunksize": MULTIPART_CHUNKSIZE,
        "retry_attempts": 4,
        "retry_base_delay": 0.01,
        "retry_max_delay": 0.05,
    }
    values.update(overrides)
    return BackendOptions(**values)


@dataclass
class StoreUnderTest:
    kind: str  # "file" | "s3"
    backend: Backend
    root: Path | None = None  # file: the directory
    bucket: str | None = None  # s3: the bucket; objects live under ``prefix``
    prefix: str = ""
    moto: MotoServer | None = None


@dataclass
class Keys:
    signing: Path
    encryption: Path


def make_keys(directory: Path) -> Keys:
    directory.mkdir(parents=True, exist_ok=True)
    keys = Keys(directory / "sign.pem", directory / "enc.key")
    generate_signing_key(keys.signing)
    generate_encryption_key(keys.encryption)
    return keys


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def bf16_like(n: int, seed: int) -> bytes:
    values = np.random.default_rng(seed).standard_normal(n // 2, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def make_tree(root: Path, seed: int = 0) -> Path:
    """A small checkpoint-like tree: nested dirs, an empty file, a sparse file, odd modes."""
    root.mkdir(parents=True)
    (root / "pages").mkdir()
    (root / "pages" / "deep" / "er").mkdir(parents=True)
    (root / "empty.img").write_bytes(b"")
    (root / "core.img").write_bytes(b"core\n" * 100)
    (root / "pages" / "pages-1.img").write_bytes(random_bytes(6 * MiB, seed))
    (root / "pages" / "weights.img").write_bytes(bf16_like(5 * MiB, seed + 1))
    (root / "pages" / "deep" / "er" / "tiny").write_bytes(b"x")
    sparse = root / "sparse.img"
    with sparse.open("wb") as fh:
        fh.truncate(12 * MiB)
        fh.seek(3 * MiB)
        fh.write(random_bytes(64 * 1024, seed + 2))
        fh.seek(11 * MiB)
        fh.write(b"tail")
    os.chmod(root / "core.img", 0o600)
    os.chmod(root / "pages" / "deep" / "er" / "tiny", 0o4755)  # setuid must not survive
    return root


def write_src(root: Path, files: dict[str, bytes]) -> Path:
    """A source directory ``root`` holding ``files`` (name: bytes)."""
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def push_tree(store: CheckpointStore, tmp_path: Path) -> PushResult:
    """``make_tree(tmp_path / "src")``, pushed as workload ``w``."""
    return store.push(make_tree(tmp_path / "src"), workload="w")


def tree_contents(root: Path) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytes, int]] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[path.relative_to(root).as_posix()] = (
                path.read_bytes(),
                path.stat().st_mode & 0o7777,
            )
    return out


def all_files(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted(p for p in root.rglob("*") if p.is_symlink() or not p.is_dir())


def file_store(
    tmp_path: Path,
    keys: Keys | None,
    *,
    name: str = "store",
    cache: str = "cache",
    encrypted: bool = False,
    verify: bool = True,
    workers: int | None = 3,
    url: str | None = None,
    options: BackendOptions | None = None,
) -> CheckpointStore:
    return open_store(
        url or f"file://{tmp_path / name}",
        key_file=keys.signing if keys else None,
        encryption_key_file=keys.encryption if (keys and encrypted) else None,
        verify=verify,
        cache_dir=tmp_path / cache,
        workers=workers,
        options=options,
    )


@dataclass
class Pushed:
    """An open store holding ``first``, a push of ``src`` as workload ``w``."""

    store: CheckpointStore
    src: Path
    first: PushResult


@contextmanager
def pushed_file_store(tmp_path: Path, keys: Keys, src: Path) -> Iterator[Pushed]:
    """``file_store(tmp_path, keys)``, open, with ``src`` pushed into it once."""
    with file_store(tmp_path, keys) as store:
        yield Pushed(store, src, store.push(src, workload="w"))


@contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``1m``) at ``mount_point``, so that ENOSPC is real.

    Skips the test where mounting is not allowed (it needs root).
    """
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def unbind_manifest(store: CheckpointStore, workload: str, checkpoint_id: str) -> str:
    """Re-sign a manifest without its ``store_id``, as one made before checkpoints were bound
    to their store; returns the id it had."""
    key = manifest_key(workload, checkpoint_id)
    envelope = json.loads(store.backend.get(key))
    body = json.loads(base64.b64decode(envelope["payload"]))
    store_id: str = body.pop("store_id")
    payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    signer = store.context.keys.signer
    store.backend.delete(key)
    store.backend.put(key, seal(ENVELOPE_FORMAT, payload, signer=signer, encryption=None))
    return store_id
