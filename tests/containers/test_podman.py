"""Podman containers checkpointed into parts and restored, with real podman, runc and CRIU.

Each test runs the generation loop (tests/containers/workload/genloop.py) in a container and
compares its token stream, after checkpoint and restore, with an uninterrupted run's: equal
bytes means the KV cache, the weights and the loop's state all came back exactly.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from gpusnap.daemon.containers import (
    PART_CONFIG,
    PART_CRIU,
    PART_ROOTFS,
    PodmanRuntime,
    container_reasons,
    load_parts,
)
from gpusnap.errors import AlreadyExists, FailedPrecondition, Unsupported
from tests.containers.harness import STEPS_DEFAULT as STEPS
from tests.containers.harness import (
    Node,
    exiting_at_checkpoint,
    genloop_spec,
    lines,
    new_loop,
    removing,
    rw_log_once_exited,
    started,
    wait_done,
    wait_lines,
)


def _figure(name: str, **values: object) -> None:
    print(f"FIGURE {json.dumps({'figure': name, **values})}")


def test_restore_in_place_continues_the_generation_bit_exactly(
    node_a: Node, tmp_path: Path
) -> None:
    rt = node_a.podman
    out, name, expected = new_loop(tmp_path, "inplace", STEPS)
    with started(rt, genloop_spec(node_a, out, steps=STEPS), name):
        wait_lines(out, STEPS // 3)
        parts = rt.checkpoint(name, tmp_path / "ckpt", leave_running=False)
        assert not rt.inspect(name).running
        at = lines(out)
        assert at < STEPS  # stopped mid-generation
        kinds = set(parts.parts.values())
        assert {PART_CRIU, PART_ROOTFS, PART_CONFIG} <= kinds
        assert any(p.startswith("checkpoint/pages-") for p in parts.parts)
        sizes = parts.sizes()
        # CRIU's own account of the pause, from the stats-dump podman exports: inside the call.
        stats = parts.criu_stats()
        assert stats["frozen_time"] > 0 and stats["pages_written"] > 0
        assert 0 < parts.pause_seconds() < parts.seconds
        _figure(
            "podman_checkpoint",
            seconds=round(parts.seconds, 3),
            pause=round(parts.pause_seconds(), 3),
            **sizes,
        )

        restored = rt.restore(load_parts(parts.directory))
        assert restored.running and restored.name == name and restored.id == parts.container.id
        assert wait_done(out) == expected


def test_restore_into_another_storage_root_continues_bit_exactly(
    node_a: Node, node_b: Node, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "migrate", STEPS)
    with (
        started(node_a.podman, genloop_spec(node_a, out, steps=STEPS), name),
        removing(node_b.podman, name),
    ):
        wait_lines(out, STEPS // 3)
        parts = node_a.podman.checkpoint(name, tmp_path / "ckpt", leave_running=False)
        assert container_reasons(parts.container, node_b.podman) == []
        restored = node_b.podman.restore(load_parts(parts.directory))
        assert restored.running and restored.runtime == "podman"
        assert restored.spec.image_id == parts.container.spec.image_id
        assert wait_done(out) == expected
        # The rw layer came along: the log written before the checkpoint, continued after it.
        log = rw_log_once_exited(node_b, name, tmp_path / "log")
        assert log == expected.removesuffix(b"done\n")


def test_leave_running_keeps_the_container_serving_and_the_checkpoint_restores(
    node_a: Node, node_b: Node, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "leave", STEPS)
    with (
        started(node_a.podman, genloop_spec(node_a, out, steps=STEPS), name),
        removing(node_b.podman, f"{name}-copy"),
    ):
        wait_lines(out, STEPS // 3)
        before = node_a.podman.inspect(name)
        parts = node_a.podman.checkpoint(name, tmp_path / "ckpt", leave_running=True)
        after = node_a.podman.inspect(name)
        assert after.running and after.pids == before.pids
        assert wait_done(out) == expected  # the original went on, undisturbed
        # The checkpoint, restored elsewhere, rewrites the stream from where it was taken.
        node_b.podman.restore(load_parts(parts.directory), name=f"{name}-copy")
        assert wait_done(out) == expected


def test_second_checkpoint_uploads_only_what_changed(node_a: Node, tmp_path: Path) -> None:
    from gpusnap.storage import generate_signing_key, open_store  # noqa: PLC0415

    out, name, _ = new_loop(tmp_path, "dedup")
    rt = node_a.podman
    with started(rt, genloop_spec(node_a, out, steps=400, weights_mib=32), name):
        wait_lines(out, 50)
        first = rt.checkpoint(name, tmp_path / "c1", leave_running=True)
        wait_lines(out, 100)
        second = rt.checkpoint(name, tmp_path / "c2", leave_running=True)
    key = tmp_path / "sign.pem"
    generate_signing_key(key)
    with open_store(
        f"file://{tmp_path / 'store'}", key_file=key, cache_dir=tmp_path / "cache", workers=2
    ) as store:
        p1 = store.push(first.directory, workload=name)
        p2 = store.push(second.directory, workload=name, parent=p1.checkpoint_id)
    ratio = p2.bytes_uploaded / p1.bytes_uploaded
    _figure(
        "podman_second_checkpoint",
        first_total=p1.bytes_total,
        first_uploaded=p1.bytes_uploaded,
        second_total=p2.bytes_total,
        second_uploaded=p2.bytes_uploaded,
        ratio=round(ratio, 4),
        first_seconds=round(first.seconds, 3),
        second_seconds=round(second.seconds, 3),
    )
    # The weights' pages and the image are the same bytes: most of the second is not new.
    assert p2.bytes_total >= p1.bytes_total * 0.9
    assert ratio < 0.5


def test_restore_where_the_image_is_missing_is_refused_with_the_reason(
    node_a: Node, tmp_path: Path
) -> None:
    short = Path(tempfile.mkdtemp(prefix="gpusnap-c-", dir="/tmp"))  # runroot < 50 characters
    bare = PodmanRuntime(
        root=tmp_path / "c/root",
        runroot=short / "run",
        tmpdir=short / "tmp",
        runtime_root=short / "runc",
        cgroup_manager="cgroupfs",
        events_backend="file",
    )
    out, name, _ = new_loop(tmp_path, "noimage")
    with started(node_a.podman, genloop_spec(node_a, out, steps=STEPS), name):
        wait_lines(out, 10)
        parts = node_a.podman.checkpoint(name, tmp_path / "ckpt", leave_running=True)
    image = parts.container.spec.image_id
    reasons = container_reasons(parts.container, bare)
    assert len(reasons) == 1 and image in reasons[0] and "not present" in reasons[0]
    with pytest.raises(FailedPrecondition, match="not present here"):
        bare.restore(load_parts(parts.directory))
    with pytest.raises(FailedPrecondition, match="not present here"):
        bare.create(parts.container.spec, name=name)
    bare.tool.run(["system", "reset", "--force"], what="reset", check=False)
    shutil.rmtree(short, ignore_errors=True)


def test_cold_start_creates_the_container_from_the_recorded_spec(
    node_a: Node, node_b: Node, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "cold", STEPS)
    with started(node_a.podman, genloop_spec(node_a, out, steps=STEPS), name):
        recorded = node_a.podman.inspect(name)
    spec = recorded.spec
    assert ("nofile", 20000, 20000) in [(u.name, u.soft, u.hard) for u in spec.ulimits]
    assert spec.network == "none" and any(m.destination == "/out" for m in spec.mounts)
    with started(node_b.podman, spec, f"{name}-b") as fresh:
        assert fresh.spec.command == spec.command
        assert wait_done(out) == expected  # from the first step: a fresh start


def test_restore_over_a_running_container_of_that_name_is_refused(
    node_a: Node, tmp_path: Path
) -> None:
    out, name, _ = new_loop(tmp_path, "busy")
    with started(node_a.podman, genloop_spec(node_a, out, steps=STEPS), name):
        wait_lines(out, 10)
        parts = node_a.podman.checkpoint(name, tmp_path / "ckpt", leave_running=True)
        with pytest.raises(AlreadyExists, match="running"):
            node_a.podman.restore(parts)
        assert node_a.podman.inspect(name).running


def test_a_container_that_exits_before_its_checkpoint_is_a_clear_error(
    node_a: Node, tmp_path: Path
) -> None:
    out, name, _ = new_loop(tmp_path, "exits")
    with started(node_a.podman, genloop_spec(node_a, out, steps=20, interval=0.01), name):
        assert node_a.podman.inspect(name).pids  # seen running (the GPU freeze would go here)
        wait_done(out)
        with pytest.raises(FailedPrecondition, match=f"{name}.*(not running|exited)"):
            node_a.podman.checkpoint(name, tmp_path / "ckpt", leave_running=False)
        assert not (tmp_path / "ckpt").exists()


def test_a_container_that_exits_during_its_checkpoint_is_a_clear_error(
    node_a: Node, tmp_path: Path
) -> None:
    out, name, _ = new_loop(tmp_path, "dies")
    spec = exiting_at_checkpoint(genloop_spec(node_a, out, steps=STEPS), tmp_path)
    with started(node_a.podman, spec, name):
        wait_lines(out, 10)
        with pytest.raises(FailedPrecondition, match=f"{name}' exited during the checkpoint"):
            node_a.podman.checkpoint(name, tmp_path / "ckpt", leave_running=True)
        assert not (tmp_path / "ckpt").exists()
        assert not node_a.podman.inspect(name).running


def test_a_missing_podman_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    rt = PodmanRuntime(binary=str(tmp_path / "no-such-podman"))
    with pytest.raises(Unsupported, match=r"podman: .*no-such-podman not found"):
        rt.inspect("anything")
    with pytest.raises(Unsupported, match="podman"):
        rt.version()
