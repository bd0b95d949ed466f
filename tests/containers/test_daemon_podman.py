"""Podman containers checkpointed and restored through a real gpusnapd and the real CLI.

Each test runs the generation loop (tests/containers/workload/genloop.py) in a podman
container, drives ``gpusnap checkpoint --container`` / ``gpusnap restore`` against daemons whose
``[containers.podman]`` point at this machine's two test storage roots ("node A" and "node B"),
and compares the token stream with an uninterrupted run's: equal bytes means the KV cache, the
weights and the loop's state all came back exactly.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from gpusnap.daemon.containers import Device
from tests.containers.daemons import Daemons, cli_json, podman_section, start_daemon
from tests.containers.harness import (
    STEPS_DEFAULT,
    Node,
    exiting_at_checkpoint,
    genloop_spec,
    lines,
    make_node,
    new_loop,
    removing,
    rw_log_once_exited,
    started,
    teardown,
    wait_done,
    wait_exited,
    wait_lines,
)
from tests.containers.image import WORKLOAD_DIR
from tests.support.mounts import tmpfs

STEPS = STEPS_DEFAULT
# Tests that look at the restored container while it runs give it this many steps (6 s).
LONG = 300


def test_a_container_checkpointed_through_gpusnapd_restores_in_place_bit_exactly(
    node_a: Node, daemons: Daemons, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "dinplace", LONG)
    a = start_daemon(daemons, "a", podman_section(node_a))
    # A device node given to the container, as a GPU's would be (/dev/null stands in).
    spec = dataclasses.replace(
        genloop_spec(node_a, out, steps=LONG), devices=(Device("/dev/null", "/dev/gpu0"),)
    )
    with started(node_a.podman, spec, name):
        wait_lines(out, LONG // 6)
        done = cli_json(a, "checkpoint", "--container", name, "--wait")
        assert done["state"] == "succeeded" and done["workload"] == name
        assert done["container"]["name"] == name
        assert done["container"]["runtime"] == "podman"
        assert done["container"]["image_digest"].startswith("sha256:")
        assert done["pause_seconds"] > 0 and done["bytes_uploaded"] > 0
        assert not node_a.podman.inspect(name).running  # kill mode
        assert lines(out) < LONG

        stamp = cli_json(a, "show", done["checkpoint_id"])["stamp"]
        c = stamp["container"]
        assert c["runtime_version"] == node_a.podman.version()
        assert c["config"]["command"][:2] == ["python3", "/gen/genloop.py"]
        assert {"nofile", "nproc"} <= {u["name"] for u in c["config"]["ulimits"]}
        assert c["parts"]["criu"] > 16 << 20  # the weights' pages, at least
        assert c["devices"] == [
            {"path": "/dev/null", "container_path": "/dev/gpu0", "permissions": "rwm"}
        ]
        assert set(c["cgroup_limits"]) >= {"memory", "pids"}

        restored = cli_json(a, "restore", done["checkpoint_id"], "--wait")
        assert restored["mode"] == "restored", restored
        assert restored["container"]["name"] == name
        assert restored["container"]["id"] == done["container"]["id"]
        assert restored["pids"] == list(node_a.podman.inspect(name).pids)
        assert wait_done(out) == expected


def test_a_container_restores_on_another_node_into_its_own_storage_bit_exactly(
    node_a: Node, node_b: Node, daemons: Daemons, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "dmigrate", LONG)
    a = start_daemon(daemons, "a", podman_section(node_a))
    b = start_daemon(daemons, "b", podman_section(node_b))
    with (
        started(node_a.podman, genloop_spec(node_a, out, steps=LONG), name),
        removing(node_b.podman, name),
    ):
        wait_lines(out, LONG // 6)
        cid = cli_json(a, "checkpoint", "--container", name, "--wait")["checkpoint_id"]
        verdict = cli_json(b, "compat", cid)
        assert verdict["compatible"] is True, verdict
        restored = cli_json(b, "restore", cid, "--wait")
        assert restored["mode"] == "restored", restored
        there = node_b.podman.inspect(name)
        assert there.running and restored["pids"] == list(there.pids)
        assert restored["container"] == there.summary()
        assert wait_done(out) == expected
        # The rw layer came along: the log written before the checkpoint, continued after it.
        log = rw_log_once_exited(node_b, name, tmp_path / "log")
        assert log == expected.removesuffix(b"done\n")


def test_leave_running_keeps_serving_and_a_second_checkpoint_uploads_only_what_changed(
    node_a: Node, node_b: Node, daemons: Daemons, tmp_path: Path
) -> None:
    steps = 400
    out, name, expected = new_loop(tmp_path, "dleave", steps, weights_mib=32)
    a = start_daemon(daemons, "a", podman_section(node_a))
    b = start_daemon(daemons, "b", podman_section(node_b))
    with (
        started(
            node_a.podman, genloop_spec(node_a, out, steps=steps, weights_mib=32), name
        ) as before,
        removing(node_b.podman, f"{name}-copy"),
    ):
        wait_lines(out, 50)
        first = cli_json(a, "checkpoint", "--container", name, "--leave-running", "--wait")
        assert first["leave_running"] is True and first["parent"] is None
        assert node_a.podman.inspect(name).pids == before.pids  # the same processes, running
        # What went up stays in node a's chunk cache ([cache] seed, on by default).
        held = cli_json(a, "cache", "stats", "--cache-dir", str(a.state_dir / "cache"))
        assert held["bytes"] >= 0.9 * first["bytes_uploaded"], (held, first["bytes_uploaded"])
        wait_lines(out, 100)
        second = cli_json(a, "checkpoint", "--container", name, "--leave-running", "--wait")
        assert second["parent"] == first["checkpoint_id"]
        ratio = second["bytes_uploaded"] / first["bytes_uploaded"]
        print(
            "FIGURE",
            {
                "figure": "gpusnapd_podman_second_checkpoint",
                "first_uploaded": first["bytes_uploaded"],
                "second_uploaded": second["bytes_uploaded"],
                "second_total": second["bytes_total"],
                "ratio": round(ratio, 4),
                "pause_seconds": [first["pause_seconds"], second["pause_seconds"]],
            },
        )
        # The weights' pages and most of the cache are the same bytes: not uploaded again.
        assert second["bytes_total"] >= first["bytes_total"] * 0.9
        assert ratio < 0.5

        # The original runs on, so its name is taken: restoring over it is refused, whole.
        busy = a.cli("restore", first["checkpoint_id"], "--wait")
        assert busy.rc == 1 and "running" in busy.stderr and "--name" in busy.stderr
        assert node_a.podman.inspect(name).running
        # The original, checkpointed twice while it ran, finishes its stream unperturbed.
        assert wait_done(out) == expected
        wait_exited(node_a, name)
        # Elsewhere, under a new name, the first checkpoint rewrites the stream from there on
        # (run after the original: two writers of one file would interleave their truncations).
        copy = cli_json(b, "restore", first["checkpoint_id"], "--name", f"{name}-copy", "--wait")
        assert copy["mode"] == "restored" and copy["container"]["name"] == f"{name}-copy"
        # Node b never held any of it: all from the store, none from its (empty) cache.
        assert copy["bytes_cached"] == 0 and copy["bytes_fetched"] > 0, copy
        wait_exited(node_b, f"{name}-copy")
        assert wait_done(out) == expected


def test_a_file_held_open_in_the_rw_layer_that_grew_after_a_leave_running_checkpoint_restores(
    node_a: Node, node_b: Node, daemons: Daemons, tmp_path: Path
) -> None:
    """The loop holds its rw-layer log open for writing (CRIU records its size), and runs on
    after the leave-running checkpoint, so the rw-layer diff podman exports has it longer
    than at the dump. The restore cuts it back to CRIU's record (``fitted_files``) and the copy
    rewrites the log from there: the whole stream, byte for byte, as the tokens are."""
    steps = 250
    out, name, expected = new_loop(tmp_path, "dhold", steps, weights_mib=4)
    spec = genloop_spec(node_a, out, steps=steps, weights_mib=4)
    spec = dataclasses.replace(spec, env=(*spec.env, "GENLOOP_HOLD_LOG=1"))
    a = start_daemon(daemons, "a", podman_section(node_a))
    b = start_daemon(daemons, "b", podman_section(node_b))
    copy_name = f"{name}-copy"
    with started(node_a.podman, spec, name), removing(node_b.podman, copy_name):
        wait_lines(out, 40)
        first = cli_json(a, "checkpoint", "--container", name, "--leave-running", "--wait")
        assert wait_done(out) == expected  # the original finishes: its log has grown since
        wait_exited(node_a, name)
        copy = cli_json(b, "restore", first["checkpoint_id"], "--name", copy_name, "--wait")
        assert copy["mode"] == "restored", copy
        (fitted,) = copy["fitted_files"]
        assert fitted["path"] == "/var/log/genloop.log", fitted
        # What CRIU recorded is whole lines of the stream, fewer than the diff held.
        full_log = expected.removesuffix(b"done\n")
        recorded = fitted["bytes_recorded"]
        assert 0 < recorded < fitted["bytes_stored"] <= len(full_log), fitted
        assert full_log[recorded - 1 : recorded] == b"\n", fitted
        assert f"cut back to {recorded}" in b.log_path.read_text(errors="replace")
        assert wait_done(out) == expected
        assert rw_log_once_exited(node_b, copy_name, tmp_path / "log") == full_log


def _workload(name: str, container: str, *, version: str = "1", start: str = "") -> str:
    return (
        f'[[workload]]\nname = "{name}"\ncontainer = "{container}"\nruntime = "podman"\n'
        f'engine = {{ name = "genloop", version = "{version}" }}\n{start}'
    )


def test_a_checkpoint_that_does_not_fit_cold_starts_a_fresh_container_from_its_config(
    node_a: Node, node_b: Node, daemons: Daemons, tmp_path: Path
) -> None:
    # Four times the usual loop (~12 s): it must still run when the checkpoint freezes it,
    # after two daemon starts and a podman round trip on a busy machine.
    steps = 4 * STEPS
    out, name, expected = new_loop(tmp_path, "dcold", steps)
    a = start_daemon(daemons, "a", podman_section(node_a) + _workload("llm", name))
    # Node B runs another build of the engine: the checkpoint must not be restored there.
    b = start_daemon(daemons, "b", podman_section(node_b) + _workload("llm", name, version="2"))
    with (
        started(node_a.podman, genloop_spec(node_a, out, steps=steps), name),
        removing(node_b.podman, name),
    ):
        wait_lines(out, STEPS // 3)
        (listed,) = cli_json(a, "workloads")["workloads"]
        assert listed["finder"] == f"container {name} (podman)"
        assert listed["running"] is True
        assert listed["pid"] == node_a.podman.inspect(name).pids[0]
        done = cli_json(a, "checkpoint", "--workload", "llm", "--wait")
        assert done["workload"] == "llm" and done["container"]["name"] == name

        cold = cli_json(b, "restore", "--workload", "llm", "--latest", "--wait")
        assert cold["mode"] == "cold-start", cold
        assert cold["launch_source"] == "checkpoint"
        assert [r["field"] for r in cold["reason_details"]] == ["engine.version"]
        fresh = node_b.podman.inspect(name)
        assert fresh.running and cold["container"] == fresh.summary()
        assert fresh.id != done["container"]["id"]  # created anew, not restored
        assert fresh.spec.ulimits == node_a.podman.inspect(name).spec.ulimits
        assert wait_done(out) == expected  # from the first step: a fresh start


def test_where_the_image_is_missing_the_restore_cold_starts_with_that_reason(
    node_a: Node, daemons: Daemons, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "dnoimage", STEPS)
    bare = make_node(tmp_path, "c", None)  # a node that never loaded the image
    try:
        a = start_daemon(daemons, "a", podman_section(node_a) + _workload("llm", name))
        command = [
            sys.executable,
            str(WORKLOAD_DIR / "genloop.py"),
            str(out),
            str(STEPS),
            "0",
            "16",
        ]
        start = f"start = {{ command = {json.dumps(command)} }}\n"
        # Two daemons over the bare root: one declares how to start the workload, one does not.
        c = start_daemon(daemons, "c", podman_section(bare) + _workload("llm", name, start=start))
        d = start_daemon(daemons, "d", podman_section(bare))
        node_a.podman.create(genloop_spec(node_a, out, steps=STEPS), name=name)
        wait_lines(out, 10)
        cid = cli_json(a, "checkpoint", "--workload", "llm", "--wait")["checkpoint_id"]
        image = node_a.podman.inspect(name).spec.image_id

        verdict = c.cli("compat", cid, "--json")
        assert verdict.rc == 1
        (reason,) = verdict.json["reasons"]
        assert reason["field"] == "container.image_digest" and reason["expected"] == image
        assert "not present on this node" in reason["message"]

        without = d.cli("restore", cid, "--wait")
        assert without.rc == 1
        assert f"image {image}" in without.stderr and "never pulls" in without.stderr
        assert "does not fit this node" in without.stderr

        cold = cli_json(c, "restore", cid, "--wait")
        assert cold["mode"] == "cold-start" and cold["launch_source"] == "config"
        assert cold["reasons"] == [reason["message"]]
        assert wait_done(out) == expected  # the node's own start ran it from the first step
    finally:
        node_a.podman.remove(name)
        teardown(bare)


def test_a_container_that_exits_mid_checkpoint_fails_the_job_and_commits_nothing(
    node_a: Node, daemons: Daemons, tmp_path: Path
) -> None:
    out, name, _ = new_loop(tmp_path, "ddies")
    spec = exiting_at_checkpoint(genloop_spec(node_a, out, steps=STEPS), tmp_path)
    a = start_daemon(daemons, "a", podman_section(node_a))
    with started(node_a.podman, spec, name):
        wait_lines(out, 10)
        res = a.cli("checkpoint", "--container", name, "--wait")
        assert res.rc == 1
        assert f"container '{name}' exited during the checkpoint" in res.stderr
        assert cli_json(a, "ls")["checkpoints"] == []
        assert not list((a.state_dir / "staging").iterdir())


def test_a_missing_or_too_old_runtime_is_a_clear_error_naming_it(
    daemons: Daemons, tmp_path: Path
) -> None:
    # The version gate reads what the binary prints; this stand-in prints podman 3.4's line.
    old = tmp_path / "podman"
    old.write_text("#!/bin/sh\necho 'podman version 3.4.4'\n")
    old.chmod(0o755)
    missing = tmp_path / "no-such-podman"
    a = start_daemon(
        daemons,
        "a",
        '[containers]\ndetect = ["podman", "runc"]\n'
        f'[containers.podman]\nbinary = "{missing}"\n[containers.runc]\nbinary = "{missing}"\n',
    )
    b = start_daemon(daemons, "b", f'[containers.podman]\nbinary = "{old}"\n')

    res = a.cli("checkpoint", "--container", "llm", "--runtime", "podman")
    assert res.rc == 1 and f"podman: {missing} not found" in res.stderr, res.stderr
    res = b.cli("checkpoint", "--container", "llm", "--runtime", "podman")
    assert res.rc == 1
    assert "podman 3.4.4 is too old; gpusnap needs podman >= 4.0" in res.stderr, res.stderr
    # Detected: runtimes that cannot run are named beside "no such container".
    res = a.cli("checkpoint", "--container", "llm")
    assert res.rc == 3 and "no container 'llm'" in res.stderr and "not found" in res.stderr
    res = a.cli("checkpoint", "--pid", "1", "--runtime", "podman")
    assert res.rc == 2 and "goes with a container" in res.stderr
    res = a.cli("restore", "--workload", "llm", "--latest", "--name", "no/slashes")
    assert res.rc == 2 and "not a container name: 'no/slashes'" in res.stderr
    # What the operator sees of each runtime, in detection order.
    caps = cli_json(a, "status")["capabilities"]["containers"]
    assert (
        caps
        == f"podman: {missing} not found (install it, see scripts/install-containers.sh); "
        + (f"runc: {missing} not found (install it, see scripts/install-containers.sh)")
    )
    caps = cli_json(b, "status")["capabilities"]["containers"]
    assert caps.startswith("podman 3.4.4 is too old") and "runc 1." in caps, caps


def test_a_kill_mode_checkpoint_whose_upload_fails_restores_the_container_from_its_parts(
    node_a: Node, daemons: Daemons, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "drescue", LONG)
    # The store is a 4 MiB file system: it answers, and fills up during the upload.
    with tmpfs(tmp_path / "small", "size=4m") as small:
        d = daemons.make("a", extra_config=podman_section(node_a), store_url=f"file://{small}")
        a = d.start()
        node_a.podman.create(genloop_spec(node_a, out, steps=LONG), name=name)
        try:
            wait_lines(out, LONG // 6)
            res = a.cli("checkpoint", "--container", name, "--wait", "--json")
            assert res.rc == 1, res.stdout + res.stderr
            error = res.json["error"]
            assert "No space left" in error or "full" in error, error
            assert "the container was restored on this node from the local checkpoint" in error
            assert node_a.podman.inspect(name).running
            assert wait_done(out) == expected  # it went on from where it was frozen
            assert cli_json(a, "ls")["checkpoints"] == []
        finally:
            node_a.podman.remove(name)
            a.stop()
