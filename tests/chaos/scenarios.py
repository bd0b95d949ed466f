"""The faults: each scenario injects one kind ``rounds`` times, with real processes, and audits
the store after each (``harness.ChaosStore.audit``). Every random choice comes from the
``random.Random`` handed in, seeded from the run's seed, so a failure replays.

- ``kill_pushes``: pushes SIGKILLed at random points (file:// and S3);
- ``s3_storms``: 503 storms, connections reset in the middle of multipart uploads, failed
  parts, lost replies of CompleteMultipartUpload and of the manifest's conditional put;
- ``full_disk``: the store's disk fills up in the middle of a push (a small real tmpfs);
- ``pushes_and_gc``: two pushes and a gc at once from separate processes;
- ``store_recreated``: the store wiped or its bucket emptied/recreated between two pushes;
- ``chunk_removed``: chunks deleted behind the store's back between two pushes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpusnap.storage.layout import chunk_key
from tests.chaos.harness import ChaosStore, MiB, make_image, mutate_image
from tests.support.faultproxy import FaultProxy

IMAGE_MIB = 12


def _latest(store: ChaosStore, workload: str) -> str | None:
    with store.open("latest") as opened:
        found = opened.latest(workload)
    return None if found is None else found.checkpoint_id


def kill_pushes(
    store: ChaosStore, rng: random.Random, rounds: int, proxy: FaultProxy | None = None
) -> None:
    """Incremental pushes killed with SIGKILL at a random point: half of them a random time
    into the run, half once they have written a random number of chunk objects (so that
    kills land while chunks go up, between the last chunk and the sync, and at the commit)."""
    image = make_image(store.work / "image-kill", rng, 2 * IMAGE_MIB)
    written = _chunk_writes(store, proxy)
    store.push_and_record(image, "killed", expect_ok=True)
    store.audit("first push")
    # How long an incremental push of this image runs, process start included: measured.
    mutate_image(image, rng)
    store.push_and_record(image, "killed", _latest(store, "killed"), expect_ok=True)
    duration = store.last_push_seconds
    for i in range(rounds):
        mutate_image(image, rng)
        fresh = rng.randint(0, 3)  # new files: chunks the store has never seen
        for n in range(fresh):
            (image / f"new-{i}-{n}.img").write_bytes(rng.randbytes(rng.randint(1, 6) * MiB))
        parent = _latest(store, "killed")
        if rng.random() < 0.5:
            when = rng.uniform(0.05, 1.0) * duration
            kill: Callable[[], bool] | float = when
            how = f"after {when:.2f}s"
        else:
            # A rewritten region costs a chunk or two; each new file 1-6 MiB, a few chunks.
            # (On S3 a chunk is about three requests: create, part, complete.)
            target = written() + rng.randint(0, (1 + 2 * fresh) * (3 if proxy else 1))
            kill = lambda target=target: written() >= target  # noqa: E731
            how = f"at {target} chunk writes"
        writes_before = written()
        rc, _err, new = store.push_and_record(image, "killed", parent, kill=kill)
        if rc != -9:
            store.tally.missed["push-sigkilled"] += 1
        elif new:
            store.tally.faults["push-sigkilled after its commit"] += 1
        elif written() > writes_before:
            store.tally.faults["push-sigkilled with chunks written, uncommitted"] += 1
        else:
            store.tally.faults["push-sigkilled before writing a chunk"] += 1
        store.audit(f"round {i}: push killed {how} (exit {rc})")
    store.push_and_record(image, "killed", _latest(store, "killed"), expect_ok=True)
    store.audit("the push after the kills")
    store.cli_verify()


def _chunk_writes(store: ChaosStore, proxy: FaultProxy | None) -> Callable[[], int]:
    """A count that grows with every chunk object a push writes."""
    if proxy is not None:
        return lambda: proxy.saw(lambda m, p: "/chunks/" in p and m in ("PUT", "POST"))
    root = Path(store.url.removeprefix("file://")) / "chunks"

    def count() -> int:
        try:
            return sum(len(os.listdir(root / d)) for d in os.listdir(root))
        except FileNotFoundError:
            return 0

    return count


def _is_part(method: str, path: str) -> bool:
    return method == "PUT" and "partNumber=" in path


def _is_complete(method: str, path: str) -> bool:
    return method == "POST" and "uploadId=" in path


def _is_manifest_put(method: str, path: str) -> bool:
    return method == "PUT" and "/manifests/" in path


S3_FAULTS = ("503-storm", "reset-parts", "503-parts", "complete-reply-lost", "manifest-reply-lost")


def _inject(proxy: FaultProxy, fault: str, rng: random.Random) -> float:
    """Arm ``fault``; how long it lasts (a storm), else 0 (it ends when its count is used)."""
    if fault == "503-storm":
        seconds = rng.uniform(0.3, 1.5)
        proxy.fail_for(seconds, status=503)
        return seconds
    if fault == "reset-parts":
        proxy.cut_next(rng.randint(1, 3), _is_part, "dropped")
    elif fault == "503-parts":
        proxy.fail_next(rng.randint(1, 4), status=503, match="partNumber=")
    elif fault == "complete-reply-lost":
        proxy.cut_next(1, _is_complete, "reply-lost")
    else:
        proxy.cut_next(1, _is_manifest_put, "reply-lost")
    return 0.0


def s3_storms(store: ChaosStore, proxy: FaultProxy, rng: random.Random, rounds: int) -> None:
    """Faults in the middle of multipart uploads; every push must still succeed (retries)."""
    image = make_image(store.work / "image-storm", rng, IMAGE_MIB)
    store.push_and_record(image, "stormy", expect_ok=True)
    for i in range(rounds):
        mutate_image(image, rng)
        (image / f"fresh-{i}.img").write_bytes(rng.randbytes(6 * 1024 * 1024))
        faults = rng.sample(S3_FAULTS, rng.randint(1, 3))
        tree = image
        proc_holder: list[tuple[int, str, set[str]]] = []

        def push(tree: Path = tree) -> None:
            parent = _latest(store, "stormy")
            proc_holder.append(store.push_and_record(tree, "stormy", parent))

        parts_before = proxy.saw(_is_part)
        pusher = threading.Thread(target=push)
        pusher.start()
        deadline = time.monotonic() + 120
        while proxy.saw(_is_part) == parts_before and pusher.is_alive():
            store.check(time.monotonic() < deadline, "the push sent no multipart part")
            time.sleep(0.005)
        for fault in faults:
            hit_before = proxy.hits()
            lasts = time.monotonic() + _inject(proxy, fault, rng)
            # One fault at a time, each given until it hits (a storm: until it has blown
            # over), or the push ends, before the next is armed.
            while pusher.is_alive() and (proxy.hits() == hit_before or time.monotonic() < lasts):
                time.sleep(0.005)
            if proxy.hits() > hit_before:
                store.tally.faults[fault] += 1
            else:
                store.tally.missed[fault] += 1
        pusher.join()
        proxy.heal()
        rc, err, _new = proc_holder[0]
        store.check(rc == 0, f"round {i}: push under {faults} failed ({rc}): {err.strip()}")
        store.audit(f"round {i}: {faults}")
    store.cli_verify()


def full_disk(store: ChaosStore, rng: random.Random, rounds: int) -> None:
    """Pushes of fresh data into a store on a small disk until it fills mid-push; gc makes
    room; nothing committed is lost and no failed push left a checkpoint."""
    fills = 0
    attempt = 0
    while fills < rounds:
        attempt += 1
        store.check(attempt < 6 * rounds + 6, f"the disk never filled in {attempt} pushes")
        image = make_image(store.work / f"image-disk-{attempt}", rng, rng.randint(5, 9))
        # One workload: gc keeps its newest checkpoint, so pushes alternate between fitting
        # and filling the disk part-way through.
        rc, err, _new = store.push_and_record(image, "disk")
        shutil.rmtree(image)
        if rc != 0:
            store.check("disk full" in err, f"a push failed, not for a full disk: {err}")
            fills += 1
            store.tally.faults["disk-full-mid-push"] += 1
        store.audit(f"push {attempt} (exit {rc})")
        if rc != 0:
            out = store.cli_ok("store", "gc", "--keep-last", "1", "--grace", "0s", "--json")
            store.forget(json.loads(out)["manifests_deleted"])
            store.audit(f"gc after the full disk of push {attempt}")
    store.cli_verify()


def pushes_and_gc(store: ChaosStore, rng: random.Random, rounds: int) -> None:
    """Two pushes (two nodes' processes) and a gc at once, started in a random order."""
    base = make_image(store.work / "image-a", rng, IMAGE_MIB)
    other = store.work / "image-b"
    shutil.copytree(base, other)  # b shares most chunks with a: both race for the same ones
    mutate_image(other, rng)
    store.push_and_record(base, "wa", node="a", expect_ok=True)
    for i in range(rounds):
        mutate_image(base, rng)
        mutate_image(other, rng)
        delays = {name: rng.uniform(0, 0.6) for name in ("a", "b", "gc")}
        results: dict[str, tuple[int, str, set[str]]] = {}
        gc_out: list[str] = []

        def run(name: str) -> None:
            time.sleep(delays[name])
            if name == "gc":
                out = store.cli_ok(
                    "store", "gc", "--keep-last", "2", "--grace", "0s", "--json", node="a"
                )
                gc_out.append(out)
            else:
                tree, workload = (base, "wa") if name == "a" else (other, "wb")
                results[name] = store.push_and_record(
                    tree, workload, _latest(store, workload), node=name
                )

        threads = [threading.Thread(target=run, args=(n,)) for n in delays]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.tally.faults["two-pushes-and-a-gc"] += 1
        for name, (rc, err, _new) in results.items():
            store.check(rc == 0, f"round {i}: push {name} failed beside a gc: {err.strip()}")
        store.forget(json.loads(gc_out[0])["manifests_deleted"])
        store.audit(f"round {i}: pushes and gc started after {delays}")
    store.cli_verify()


def store_recreated(store: ChaosStore, rng: random.Random, rounds: int) -> None:
    """The store wiped (or its bucket emptied/recreated) between two pushes of one node."""
    image = make_image(store.work / "image-recreated", rng, IMAGE_MIB)
    store.push_and_record(image, "reborn", expect_ok=True)
    for i in range(rounds):
        how = store.wipe(rng)
        store.tally.faults[how] += 1
        if rng.random() < 0.5:
            mutate_image(image, rng)
        rc, err, _new = store.push_and_record(image, "reborn", expect_ok=True)
        store.audit(f"round {i}: push after {how} (exit {rc}: {err.strip()})")
    store.cli_verify()


def chunk_removed(store: ChaosStore, rng: random.Random, rounds: int) -> None:
    """Chunks deleted behind the store's back (an operator's rm, a lifecycle rule) between
    two pushes. The next push must not name them unless it put them back; verify names
    exactly the checkpoints still damaged; pushing their bytes again repairs them."""
    image = make_image(store.work / "image-removed", rng, IMAGE_MIB)
    store.push_and_record(image, "pruned", expect_ok=True)
    for i in range(rounds):
        old = _latest(store, "pruned")
        assert old is not None
        saved = store.work / f"saved-{i}"
        shutil.copytree(image, saved)
        with store.open("rm") as opened:
            ids = sorted(opened.manifest(old).chunk_ids())
            victims = set(rng.sample(ids, rng.randint(1, min(3, len(ids)))))
            for victim in victims:
                opened.backend.delete(chunk_key(victim))
        store.tally.faults["chunk-removed"] += len(victims)
        mutate_image(image, rng)
        store.push_and_record(image, "pruned", old, expect_ok=True)
        still_missing = victims - store.chunk_ids()
        damage: dict[str, set[str]] = {}
        with store.open("damage") as opened:
            for checkpoint_id in store.expected:
                hit = opened.manifest(checkpoint_id).chunk_ids() & still_missing
                if hit:
                    damage[checkpoint_id] = hit
        store.audit(f"round {i}: {len(victims)} chunks removed, then a push", damage)
        # The old bytes pushed again put the lost chunks back: nothing is damaged any more.
        store.push_and_record(saved, "pruned-repair", expect_ok=True)
        shutil.rmtree(saved)
        store.audit(f"round {i}: after pushing the old bytes again")
    store.cli_verify()
