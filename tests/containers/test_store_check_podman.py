"""The daemon's background store check for a podman container, through a real gpusnapd and
podman: a chunk of the container's latest checkpoint lost behind the store's back is found,
shown by ``gpusnap status``, and makes the container's next checkpoint a full one, which puts
the chunk back; the store then verifies clean and that checkpoint restores bit-exactly.

The process-tree twin is tests/e2e/test_store_check.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from gpusnap.storage.layout import chunk_key
from tests.containers.daemons import Daemons, cli_json, podman_section
from tests.containers.harness import (
    Node,
    genloop_spec,
    lines,
    new_loop,
    started,
    wait_lines,
)
from tests.e2e.store_reading import StoreReader, store_check, until

# Long enough never to end within the test (which stops the container itself); the tokens are
# compared as a prefix of an uninterrupted run's.
STEPS = 5000
WEIGHTS_MIB = 4


def _now(store_dir: Path) -> float:
    """Now, by the clock that stamps the store's files (it may lag ``time.time()``)."""
    marker = store_dir.parent / "now"
    marker.write_bytes(b"")
    return marker.stat().st_mtime


def _written(store_dir: Path, chunk_id: str) -> float:
    """When the store's object of ``chunk_id`` was last written."""
    return (store_dir / chunk_key(chunk_id)).stat().st_mtime


def test_a_lost_chunk_of_a_container_checkpoint_is_repaired_by_a_full_next_checkpoint(
    node_a: Node, daemons: Daemons, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "dfull", STEPS, weights_mib=WEIGHTS_MIB)
    d = daemons.make("a", extra_config=podman_section(node_a))
    d.write_config(
        store_section=f'url = "{d.store_url}"\nkey_file = "{d.key_file}"\ncheck_interval = 0.5\n'
    )
    a = d.start()
    reader = StoreReader(a.store_url, a.key_file, tmp_path / "reader-cache")
    spec = genloop_spec(node_a, out, steps=STEPS, weights_mib=WEIGHTS_MIB)
    with started(node_a.podman, spec, name):
        wait_lines(out, 20)
        first = cli_json(a, "checkpoint", "--container", name, "--leave-running", "--wait")
        wait_lines(out, 40)
        latest = cli_json(a, "checkpoint", "--container", name, "--leave-running", "--wait")
        assert latest["parent"] == first["checkpoint_id"] and latest["full"] is False
        in_first = reader.chunks(first["checkpoint_id"])
        in_latest = reader.chunks(latest["checkpoint_id"])
        # A chunk both checkpoints name, of a part the next checkpoint writes the same (the
        # container's OCI spec), so the full checkpoint puts it back and every checkpoint
        # naming it is whole again. (The pages of the loop's state change at every step.)
        (lost,) = [c for c, part in in_latest.items() if c in in_first and part == "spec.dump"]
        (daemons.store_dir / chunk_key(lost)).unlink()  # behind the store's back: an rm
        lost_at = time.time()

        check = until(
            "a check to find the lost chunk",
            lambda: (
                (c := store_check(a))["last_check_at"] is not None
                and c["last_check_at"] > lost_at
                and c
            ),
            a,
        )
        damaged = {x["checkpoint_id"]: (x["missing_chunks"], x["latest"]) for x in check["damaged"]}
        assert damaged == {first["checkpoint_id"]: (1, False), latest["checkpoint_id"]: (1, True)}
        assert check["chunks_missing"] == 1, check
        assert list(check["full_next"]) == [name], check
        assert latest["checkpoint_id"] in check["full_next"][name]

        # The next checkpoint (kill mode: it is what the restore brings back) uploads every
        # chunk, streamed while podman still exported the parts, as a first checkpoint is.
        wait_lines(out, 60)
        began = _now(daemons.store_dir)
        full = cli_json(a, "checkpoint", "--container", name, "--wait")
        assert full["full"] is True and latest["checkpoint_id"] in full["full_reason"], full
        assert full["parent"] == latest["checkpoint_id"]
        in_full = reader.chunks(full["checkpoint_id"])
        assert lost in in_full
        # Every chunk object it names was written by it (an incremental one leaves those its
        # parent has as they were).
        assert all(_written(daemons.store_dir, c) >= began for c in in_full)
        assert full["chunks_uploaded"] >= len(in_full) > latest["chunks_uploaded"]
        assert full["bytes_uploaded"] > latest["bytes_uploaded"]
        print(
            "FIGURE",
            {
                "figure": "gpusnapd_podman_full_after_store_check",
                "incremental": [latest["chunks_uploaded"], latest["bytes_uploaded"]],
                "full": [full["chunks_uploaded"], full["bytes_uploaded"]],
                "totals": [full["chunks_total"], full["bytes_total"]],
            },
        )
        assert "container-part" in reader.stream_kinds(full["checkpoint_id"])
        assert "container-part" not in reader.stream_kinds(latest["checkpoint_id"])
        committed_at = time.time()
        assert store_check(a)["full_next"] == {}

        clean = until(
            "a check after the full checkpoint",
            lambda: (c := store_check(a))["last_check_at"] > committed_at and c,
            a,
        )
        assert clean["damaged"] == [] and clean["chunks_missing"] == 0, clean
        assert clean["full_next"] == {}
        verify = reader.verify_all(a)
        assert verify.rc == 0, verify.stdout + verify.stderr

        restored = cli_json(a, "restore", full["checkpoint_id"], "--wait")
        assert restored["mode"] == "restored", restored
        at_restore = lines(out)
        wait_lines(out, at_restore + 20)
        # The loop's hash chain went on from the restored memory, byte for byte.
        tokens = (out / "tokens").read_bytes()
        tokens = tokens[: tokens.rfind(b"\n") + 1]
        assert tokens.count(b"\n") >= at_restore + 20
        assert tokens == expected[: len(tokens)]
