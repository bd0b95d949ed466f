"""The chaos suite's machinery: stores under test, pushes as real ``gpusnap`` processes, images
that change between checkpoints, and the audit every fault must pass.

Shared by ``tests/chaos`` (a CI-sized run) and ``bench/chaos_bench.py`` (``--chaos-rounds``).

The audit (``audit``), after every fault: every checkpoint the store lists pulls back
byte-identical to the tree its push read; ``verify --read-data`` passes, or names exactly the
damage the scenario did on purpose (and nothing else); and no checkpoint was committed that
names a chunk the store lacks (the verify of every listed checkpoint proves it). A checkpoint
that was committed and does not pass is *lost*: the number that must stay 0.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from gpusnap.errors import GpusnapError
from gpusnap.storage import BackendOptions, CheckpointStore, open_store
from gpusnap.storage.layout import CHUNK_PREFIX, chunk_id_of_key
from tests.cli._cli import GPUSNAP
from tests.support.moto_server import TEST_REGION, MotoServer

MiB = 1024 * 1024
# Chunks go up as multipart uploads from 1 MiB (most of them: FastCDC's average is 2 MiB),
# in 5 MiB parts (S3's floor), so that faults land in the middle of multipart uploads.
S3_MULTIPART = ["--multipart-threshold", "1MiB", "--multipart-chunksize", "5MiB"]


@dataclass(frozen=True)
class ChaosRun:
    seed: int
    rounds: int

    def rng(self, scenario: str) -> random.Random:
        """The random choices of one scenario: its own stream, from the run's seed."""
        return random.Random(f"{self.seed}/{scenario}")


class ChaosFailure(AssertionError):
    """An invariant broke; the message carries the seed that replays it."""


@dataclass
class Tally:
    """What one run did and found."""

    faults: Counter[str] = field(default_factory=Counter)  # injected and hit
    missed: Counter[str] = field(default_factory=Counter)  # armed; the push ended first
    pushes_committed: int = 0
    pushes_failed: int = 0
    checkpoints_verified: int = 0  # audited: pulled back byte-identical
    damage_named: int = 0  # checkpoints damaged on purpose that verify named exactly
    checkpoints_lost: int = 0

    def add(self, other: Tally) -> None:
        self.faults.update(other.faults)
        self.missed.update(other.missed)
        self.pushes_committed += other.pushes_committed
        self.pushes_failed += other.pushes_failed
        self.checkpoints_verified += other.checkpoints_verified
        self.damage_named += other.damage_named
        self.checkpoints_lost += other.checkpoints_lost

    def as_dict(self) -> dict[str, Any]:
        return {
            "faults_injected": sum(self.faults.values()),
            "faults": dict(sorted(self.faults.items())),
            "faults_missed": dict(sorted(self.missed.items())),
            "pushes_committed": self.pushes_committed,
            "pushes_failed": self.pushes_failed,
            "checkpoints_verified": self.checkpoints_verified,
            "damage_named": self.damage_named,
            "checkpoints_lost": self.checkpoints_lost,
        }


# --- images --------------------------------------------------------------------------------


def make_image(root: Path, rng: random.Random, mib: int) -> Path:
    """A CRIU-like image of about ``mib`` MiB of incompressible bytes in a few files."""
    if root.exists():
        shutil.rmtree(root)
    (root / "gpu").mkdir(parents=True)
    sizes = {"pages-1.img": mib * 6 // 10, "gpu/dev-0.bin": mib * 3 // 10, "pages-2.img": 1}
    for rel, size in sizes.items():
        (root / rel).write_bytes(rng.randbytes(max(1, size) * MiB))
    (root / "core-1.img").write_bytes(rng.randbytes(8192))
    (root / "empty").write_bytes(b"")
    return root


def mutate_image(root: Path, rng: random.Random) -> None:
    """What changes between two checkpoints: a region rewritten, sometimes pages appended."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_size > MiB)
    target = rng.choice(files)
    size = target.stat().st_size
    length = rng.randint(64 * 1024, min(size, 2 * MiB))
    offset = rng.randrange(0, size - length + 1)
    with open(target, "r+b") as f:
        f.seek(offset)
        f.write(rng.randbytes(length))
        if rng.random() < 0.3:
            f.seek(0, os.SEEK_END)
            f.write(rng.randbytes(rng.randint(1, 512) * 4096))


def digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): blake3(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- a store under chaos -------------------------------------------------------------------


@dataclass
class ChaosStore:
    """One store the suite works on: how the CLI reaches it (through the fault proxy, for
    S3), how the audit reaches it (directly), and what each checkpoint must contain."""

    kind: str  # "file" | "s3"
    url: str
    work: Path
    key: Path
    seed: int
    moto: MotoServer | None = None
    bucket: str | None = None
    endpoint: str | None = None  # the CLI's (a FaultProxy in front of moto)
    expected: dict[str, dict[str, str]] = field(default_factory=dict)
    tally: Tally = field(default_factory=Tally)
    last_push_seconds: float = 0.0  # the last push process's run, start to exit

    @classmethod
    def on_file(cls, work: Path, seed: int, root: Path | None = None) -> ChaosStore:
        work.mkdir(parents=True, exist_ok=True)
        store = cls("file", f"file://{root or work / 'store'}", work, work / "node.key", seed)
        store._keygen()
        return store

    @classmethod
    def on_s3(
        cls, work: Path, seed: int, moto: MotoServer, bucket: str, endpoint: str | None = None
    ) -> ChaosStore:
        work.mkdir(parents=True, exist_ok=True)
        moto.create_bucket(bucket)
        store = cls(
            "s3",
            f"s3://{bucket}/ckpt",
            work,
            work / "node.key",
            seed,
            moto=moto,
            bucket=bucket,
            endpoint=endpoint or moto.endpoint_url,
        )
        store._keygen()
        return store

    def _keygen(self) -> None:
        if not self.key.exists():
            self.cli_ok("store", "keygen", "--out", str(self.key))

    # -- processes --------------------------------------------------------------------------

    def env(self, node: str = "node") -> dict[str, str]:
        env = {
            **os.environ,
            "GPUSNAP_STORE": self.url,
            "GPUSNAP_KEY_FILE": str(self.key),
            "XDG_CACHE_HOME": str(self.work / f"cache-{node}"),  # each node its own index
        }
        env.pop("GPUSNAP_DEBUG", None)
        if self.kind == "s3":
            assert self.endpoint is not None
            env.update(
                AWS_ENDPOINT_URL=self.endpoint,
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION=TEST_REGION,
                AWS_EC2_METADATA_DISABLED="true",
            )
        return env

    def store_args(self) -> list[str]:
        return S3_MULTIPART if self.kind == "s3" else []

    def cli(self, *args: str, node: str = "node", timeout: float = 300) -> tuple[int, str, str]:
        proc = subprocess.run(
            [*GPUSNAP, *args],
            env=self.env(node),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        self.check(
            "Traceback" not in proc.stderr, f"gpusnap {' '.join(args)}: traceback: {proc.stderr}"
        )
        return proc.returncode, proc.stdout, proc.stderr

    def cli_ok(self, *args: str, node: str = "node") -> str:
        rc, out, err = self.cli(*args, node=node)
        self.check(rc == 0, f"gpusnap {' '.join(args)} -> {rc}: {err.strip()}")
        return out

    def start_push(
        self, image: Path, workload: str, parent: str | None = None, node: str = "node"
    ) -> subprocess.Popen[str]:
        args = ["store", "push", str(image), "--workload", workload, "--json", *self.store_args()]
        if parent is not None:
            args += ["--parent", parent]
        return subprocess.Popen(
            [*GPUSNAP, *args],
            env=self.env(node),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def finish(self, proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str, str]:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise self.failure(f"a push hung for {timeout}s: {err[-2000:]}") from None
        self.check("Traceback" not in err, f"push printed a traceback: {err}")
        return proc.returncode, out, err

    def push_and_record(
        self,
        image: Path,
        workload: str,
        parent: str | None = None,
        *,
        node: str = "node",
        kill: float | Callable[[], bool] | None = None,
        expect_ok: bool = False,
    ) -> tuple[int, str, set[str]]:
        """Push ``image`` and record what any checkpoint it committed must hold; with
        ``kill``, SIGKILL it after that many seconds, or once ``kill()`` is true. Returns
        (exit status, stderr, new checkpoint ids)."""
        tree = digest(image)
        before = self.listed(workload)
        started = time.monotonic()
        proc = self.start_push(image, workload, parent, node)
        if isinstance(kill, float | int):
            try:
                proc.wait(timeout=kill)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
        elif kill is not None:
            while proc.poll() is None and not kill():
                time.sleep(0.002)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        rc, out, err = self.finish(proc)
        self.last_push_seconds = time.monotonic() - started
        # Pushes of other workloads may commit meanwhile (two nodes at once): only this
        # workload's new checkpoint can be this push's.
        new = self.listed(workload) - before
        self.check(len(new) <= 1, f"one push committed {len(new)} checkpoints: {new}")
        if rc == 0:
            self.check(
                new == {json.loads(out)["checkpoint_id"]}, f"push said {out}, the store {new}"
            )
        for checkpoint_id in new:
            self.expected[checkpoint_id] = tree
        if rc == 0:
            self.tally.pushes_committed += 1
            self.check(len(new) == 1, "a push that succeeded committed nothing")
        else:
            self.tally.pushes_failed += 1
            if rc != -signal.SIGKILL:
                lines = err.strip().splitlines()
                self.check(
                    len(lines) == 1 and lines[0].startswith("gpusnap: error: "),
                    f"a failed push must say why in one line, got: {err!r}",
                )
        if expect_ok:
            self.check(rc == 0, f"push of {workload} failed ({rc}): {err.strip()}")
        return rc, err, new

    # -- the store, directly ----------------------------------------------------------------

    def open(self, name: str = "audit") -> CheckpointStore:
        """The store opened in this process, with a fresh index: it believes only the store."""
        cache = self.work / f"cache-{name}-{time.monotonic_ns()}"
        options = None
        if self.kind == "s3":
            assert self.moto is not None
            options = BackendOptions(
                endpoint_url=self.moto.endpoint_url, region=TEST_REGION, addressing_style="path"
            )
        return open_store(self.url, key_file=self.key, cache_dir=cache, options=options, workers=2)

    def listed(self, workload: str | None = None) -> set[str]:
        with self.open("ls") as store:
            return {s.checkpoint_id for s in store.list(workload)}

    def chunk_ids(self) -> set[str]:
        with self.open("chunks") as store:
            return {
                cid for i in store.backend.list(CHUNK_PREFIX) if (cid := chunk_id_of_key(i.key))
            }

    def wipe(self, rng: random.Random) -> str:
        """The store recreated under the same URL: its directory removed, or its bucket
        emptied (or deleted and created again). Every checkpoint goes with it."""
        self.expected.clear()
        if self.kind == "file":
            shutil.rmtree(self.url.removeprefix("file://"), ignore_errors=True)
            return "file-store-wiped"
        assert self.moto is not None and self.bucket is not None
        client = self.moto.client()
        try:
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket):
                for obj in page.get("Contents", []):
                    client.delete_object(Bucket=self.bucket, Key=obj["Key"])
            if rng.random() < 0.5:
                client.delete_bucket(Bucket=self.bucket)
                client.create_bucket(Bucket=self.bucket)
                return "bucket-recreated"
            return "bucket-emptied"
        finally:
            client.close()

    def forget(self, checkpoint_ids: list[str]) -> None:
        """Checkpoints a gc's retention deleted on purpose."""
        for checkpoint_id in checkpoint_ids:
            self.expected.pop(checkpoint_id, None)

    # -- the audit --------------------------------------------------------------------------

    def failure(self, what: str) -> ChaosFailure:
        return ChaosFailure(
            f"{what} [chaos seed {self.seed}: replay with GPUSNAP_CHAOS_SEED={self.seed}]"
        )

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            raise self.failure(what)

    def audit(self, where: str, damage: dict[str, set[str]] | None = None) -> None:
        """Every listed checkpoint restores byte-identical; verify names exactly ``damage``
        (checkpoint id -> the chunk ids this scenario removed from it on purpose)."""
        damage = {k: v for k, v in (damage or {}).items() if v}
        with self.open() as store:
            listed, skipped = store.list_checked()
            self.check(not skipped, f"{where}: unreadable manifests {skipped}")
            report = store.verify(read_data=True)
            found = {k: set(v) for k, v in report.damaged.items()}
            self.check(
                found == damage,
                f"{where}: verify found damage {found}, the scenario did {damage}: "
                f"{report.problems}",
            )
            unexplained = [p for p in report.problems if not p.startswith(("missing", "damaged"))]
            self.check(not unexplained and not report.warnings, f"{where}: {report.problems}")
            self.check(bool(damage) or report.ok, f"{where}: verify: {report.problems}")
            self.tally.damage_named += len(damage)
            for summary in listed:
                checkpoint_id = summary.checkpoint_id
                self.check(
                    checkpoint_id in self.expected,
                    f"{where}: checkpoint {checkpoint_id} was committed by no push of this run",
                )
                if checkpoint_id in damage:
                    continue
                dest = self.work / f"pull-{checkpoint_id}"
                try:
                    store.pull(checkpoint_id, dest, direct=False, durable=False)
                    intact = digest(dest) == self.expected[checkpoint_id]
                except GpusnapError as exc:
                    intact, why = False, str(exc)
                else:
                    why = "its files differ from the tree that was pushed"
                finally:
                    shutil.rmtree(dest, ignore_errors=True)
                if not intact:
                    self.tally.checkpoints_lost += 1
                    raise self.failure(f"{where}: checkpoint {checkpoint_id} is lost: {why}")
                self.tally.checkpoints_verified += 1
            gone = set(self.expected) - {s.checkpoint_id for s in listed}
            self.check(not gone, f"{where}: committed checkpoints vanished: {sorted(gone)}")

    def cli_verify(self) -> None:
        """The operator's check, as a real process: ``store verify --all --read-data``."""
        self.cli_ok("store", "verify", "--all", "--read-data", *self.store_args())
