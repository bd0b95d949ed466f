"""Running the real ``gpusnap`` CLI as a subprocess, the way an operator or a script does."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The interpreter running the tests has gpusnap installed (editable) in its environment.
GPUSNAP = [sys.executable, "-m", "gpusnap.cli.main"]
CONSOLE_SCRIPT = Path(sys.executable).parent / "gpusnap"
UNKNOWN_ID = "20200101T000000Z-0123456789"  # well formed, never pushed


@dataclass
class Result:
    args: list[str]
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def __str__(self) -> str:
        return f"gpusnap {' '.join(self.args)} -> {self.rc}\nstdout: {self.out}\nstderr: {self.err}"


@dataclass
class Cli:
    """``gpusnap`` with a store and a signing key set through the environment."""

    env: dict[str, str] = field(default_factory=dict)

    def __call__(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> Result:
        full_env = {**os.environ, **self.env, **(env or {})}
        full_env.pop("GPUSNAP_DEBUG", None)
        proc = subprocess.run(
            [*GPUSNAP, *args],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        result = Result(list(args), proc.returncode, proc.stdout, proc.stderr)
        # Never a traceback, whatever happened.
        assert "Traceback" not in proc.stderr, str(result)
        return result

    def ok(self, *args: str, **kw: Any) -> Result:
        result = self(*args, **kw)
        assert result.rc == 0, str(result)
        return result

    def push(self, src: Path, workload: str, *extra: str) -> dict[str, Any]:
        data: dict[str, Any] = self.ok(
            "store", "push", str(src), "--workload", workload, "--json", *extra
        ).json()
        return data

    def ids(self, *extra: str) -> list[str]:
        listing = self.ok("store", "ls", "--json", *extra).json()
        return [c["checkpoint_id"] for c in listing["checkpoints"]]

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def make_cli(tmp: Path, store_url: str | None = None, **env: str) -> Cli:
    """A Cli on a fresh file:// store under ``tmp`` with a new signing key (made by keygen)."""
    key = tmp / "signing.key"
    cli = Cli(
        {
            "GPUSNAP_STORE": store_url or f"file://{tmp / 'store'}",
            "GPUSNAP_KEY_FILE": str(key),
            "XDG_CACHE_HOME": str(tmp / "cache"),  # the chunk index stays inside the test
            **env,
        }
    )
    cli.ok("store", "keygen", "--out", str(key))
    return cli


def write_tree(root: Path, seed: int = 0, big: int = 3 * 1024 * 1024) -> dict[str, bytes]:
    """A small image: nested dirs, an empty file, an executable, some MiB of random bytes."""
    rng = random.Random(seed)
    files = {
        "core-1.img": rng.randbytes(4096),
        "sub/dir/pages-1.img": rng.randbytes(big),
        "sub/zeros.bin": bytes(256 * 1024),
        "empty": b"",
        "run.sh": b"#!/bin/sh\necho hi\n",
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "run.sh").chmod(0o755)
    return files


def image_tree(tmp: Path, seed: int = 0) -> Path:
    """``write_tree`` at ``tmp/image``: the image a test pushes."""
    image = tmp / "image"
    write_tree(image, seed=seed)
    return image


def tree_of(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() or p.is_symlink()] if root.exists() else []
