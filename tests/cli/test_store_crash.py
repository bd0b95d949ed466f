"""Crash consistency: ``gpusnap store push`` killed with SIGKILL at random points.

After every kill the store holds either no new checkpoint or a complete one, ``verify --all``
passes, and the final push reuses the chunks the killed pushes got into the store.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli._cli import GPUSNAP, Cli, make_cli

MiB = 1024 * 1024
KILL_FRACTIONS_SEED = 20261130


def _make_tree(root: Path) -> int:
    """256 MiB of unique, incompressible data over a few files (like CRIU page images)."""
    rng = random.Random(7)
    sizes = {"pages-1.img": 128 * MiB, "pages-2.img": 96 * MiB, "gpu/dev-0.bin": 32 * MiB}
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for _ in range(size // (8 * MiB)):
                f.write(rng.randbytes(8 * MiB))
    (root / "core-1.img").write_bytes(b"core" * 1000)
    return sum(sizes.values()) + 4000


def _stored_bytes(store: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(store):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass  # a temp file renamed or removed under us
    return total


def _push_and_kill_at(cli: Cli, image: Path, store: Path, target_bytes: int) -> bool:
    """Start a push; SIGKILL it once the store has grown by ``target_bytes``.

    Returns whether it was killed (False: it finished first).
    """
    start = _stored_bytes(store)
    proc = subprocess.Popen(
        [*GPUSNAP, "store", "push", str(image), "--workload", "crashy"],
        env=cli.environ(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        while proc.poll() is None:
            if _stored_bytes(store) - start >= target_bytes:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    assert "Traceback" not in err
    return proc.returncode == -signal.SIGKILL


def _digest_tree(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            h = hashlib.blake2b()
            with open(path, "rb") as f:
                while block := f.read(4 * MiB):
                    h.update(block)
            out[path.relative_to(root).as_posix()] = h.hexdigest()
    return out


@pytest.mark.slow
def test_push_killed_at_random_points_leaves_no_partial_checkpoint_and_is_reused(
    tmp_path: Path,
) -> None:
    cli = make_cli(tmp_path)
    store = tmp_path / "store"
    image = tmp_path / "image"
    total = _make_tree(image)

    rng = random.Random(KILL_FRACTIONS_SEED)
    # Spread over the whole push, from just after it starts writing to just before commit.
    fractions = sorted([0.02, 0.97, *(rng.uniform(0.05, 0.95) for _ in range(3))])
    killed = 0
    committed: set[str] = set()
    for fraction in fractions:
        was_killed = _push_and_kill_at(cli, image, store, int(total * fraction))
        killed += was_killed
        ids = set(cli.ids())
        new = ids - committed
        # Either nothing new, or one checkpoint that verify (below) proves complete.
        assert len(new) <= 1, (fraction, new)
        committed |= new
        verify = cli("store", "verify", "--all")
        assert verify.rc == 0, str(verify)
    assert killed >= 3, "the pushes finished before they could be killed"

    final = cli.push(image, "crashy")
    assert final["bytes_total"] == total
    assert final["chunks_uploaded"] < final["chunks_total"]
    assert final["bytes_uploaded"] < final["bytes_total"], final
    cli.ok("store", "verify", "--all", "--read-data")

    dest = tmp_path / "restored"
    cli.ok("store", "pull", final["checkpoint_id"], str(dest))
    assert _digest_tree(dest) == _digest_tree(image)
