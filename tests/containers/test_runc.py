"""runc containers (bundles with an overlay rootfs over an image directory) checkpointed into
parts and restored, in place and on "another node" (a second runc state root and bundle dir),
with real runc and CRIU."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.containers import RuncRuntime, container_reasons, load_parts
from gpusnap.errors import FailedPrecondition, Unsupported
from tests.containers.daemons import Daemons, cli_json, start_daemon
from tests.containers.harness import STEPS_DEFAULT as STEPS
from tests.containers.harness import (
    TIMEOUT,
    genloop_spec_for,
    lines,
    new_loop,
    wait_done,
    wait_lines,
)
from tests.containers.image import rootfs_tar

IMAGE_ID = "sha256:" + "6e" * 32  # the id the test gives its image directory


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("runc-images")
    rootfs = d / IMAGE_ID.removeprefix("sha256:") / "rootfs"
    rootfs.mkdir(parents=True)
    subprocess.run(
        ["tar", "-C", str(rootfs), "-xf", str(rootfs_tar())], check=True, timeout=TIMEOUT
    )
    return d


def _node(images: Path, name: str) -> Iterator[RuncRuntime]:
    d = Path(tempfile.mkdtemp(prefix=f"gpusnap-runc-{name}-", dir="/tmp"))
    rt = RuncRuntime(root=d / "state", bundles=d / "bundles", images=images)
    try:
        yield rt
    finally:
        proc = rt.tool.run(["list", "--quiet"], what="list", check=False)
        for ref in proc.stdout.split():
            rt.remove(ref)
        for rootfs in (d / "bundles").glob("*/rootfs"):  # bundles whose container never ran
            subprocess.run(["umount", str(rootfs)], capture_output=True, check=False)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def runc_a(images: Path) -> Iterator[RuncRuntime]:
    yield from _node(images, "a")


@pytest.fixture
def runc_b(images: Path) -> Iterator[RuncRuntime]:
    yield from _node(images, "b")


def test_runc_restore_in_place_continues_bit_exactly(runc_a: RuncRuntime, tmp_path: Path) -> None:
    out, name, expected = new_loop(tmp_path, "runc", STEPS)
    runc_a.create(genloop_spec_for(IMAGE_ID, out, steps=STEPS), name=name)
    wait_lines(out, STEPS // 3)
    parts = runc_a.checkpoint(name, tmp_path / "ckpt", leave_running=False)
    assert lines(out) < STEPS
    assert any(p.startswith("criu/pages-") for p in parts.parts)
    assert {"config.json", "rootfs-diff.tar"} <= set(parts.parts)
    assert "frozen_time" in parts.criu_stats()  # criu/stats-dump
    assert 0 < parts.pause_seconds() < parts.seconds
    print(f"FIGURE runc_checkpoint seconds={parts.seconds:.3f} sizes={parts.sizes()}")
    restored = runc_a.restore(load_parts(parts.directory))
    assert restored.running and restored.name == name
    assert wait_done(out) == expected


def test_runc_restore_on_another_node_with_a_new_name_continues_bit_exactly(
    runc_a: RuncRuntime, runc_b: RuncRuntime, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "runc", STEPS)
    runc_a.create(genloop_spec_for(IMAGE_ID, out, steps=STEPS), name=name)
    wait_lines(out, STEPS // 3)
    parts = runc_a.checkpoint(name, tmp_path / "ckpt", leave_running=False)
    assert container_reasons(parts.container, runc_b) == []
    restored = runc_b.restore(load_parts(parts.directory), name=f"{name}-b")
    assert restored.running
    assert wait_done(out) == expected
    # The rw layer came along in the rootfs diff: the log the loop keeps in the container.
    log = runc_b.bundles / f"{name}-b" / "upper" / "var/log/genloop.log"
    assert log.read_bytes() == expected.removesuffix(b"done\n")


def test_runc_leave_running_keeps_the_container_serving(
    runc_a: RuncRuntime, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "runc", STEPS)
    before = runc_a.create(genloop_spec_for(IMAGE_ID, out, steps=STEPS), name=name)
    wait_lines(out, STEPS // 3)
    parts = runc_a.checkpoint(name, tmp_path / "ckpt", leave_running=True)
    assert runc_a.inspect(name).pids == before.pids
    assert parts.leave_running
    assert wait_done(out) == expected


def test_runc_fits_a_file_held_open_in_the_rw_layer_back_to_its_recorded_size(
    runc_a: RuncRuntime, runc_b: RuncRuntime, tmp_path: Path
) -> None:
    """The loop holds its rw-layer log open for writing and runs on after a leave-running
    checkpoint: longer than CRIU recorded both in the checkpoint's diff (restored on node b)
    and in its own upper directory (restored in place after it exited). ``fit_open_files``
    cuts it back, as the daemon's restore body does, and each restore rewrites the whole
    stream from there, log and tokens alike."""
    out, name, expected = new_loop(tmp_path, "runc", STEPS)
    spec = genloop_spec_for(IMAGE_ID, out, steps=STEPS)
    env = (*(spec.env or ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)), "GENLOOP_HOLD_LOG=1")
    runc_a.create(dataclasses.replace(spec, env=env), name=name)
    wait_lines(out, STEPS // 3)
    parts = load_parts(runc_a.checkpoint(name, tmp_path / "ckpt", leave_running=True).directory)
    assert wait_done(out) == expected
    full_log = expected.removesuffix(b"done\n")
    upper_log = runc_a.bundles / name / "upper" / "var/log/genloop.log"
    assert upper_log.read_bytes() == full_log

    (elsewhere,) = runc_b.fit_open_files(parts, name=f"{name}-b")
    assert elsewhere.path == "/var/log/genloop.log"
    assert 0 < elsewhere.bytes_recorded < elsewhere.bytes_stored <= len(full_log)
    assert runc_b.restore(parts, name=f"{name}-b").running
    assert wait_done(out) == expected
    log_b = runc_b.bundles / f"{name}-b" / "upper" / "var/log/genloop.log"
    assert log_b.read_bytes() == full_log

    (in_place,) = runc_a.fit_open_files(parts)  # the upper directory, as the original left it
    assert (in_place.bytes_stored, in_place.bytes_recorded) == (
        len(full_log),
        elsewhere.bytes_recorded,
    )
    assert upper_log.stat().st_size == elsewhere.bytes_recorded
    assert runc_a.restore(parts).running
    assert wait_done(out) == expected
    assert upper_log.read_bytes() == full_log


def test_runc_restore_without_the_image_is_refused_with_the_reason(
    runc_a: RuncRuntime, tmp_path: Path
) -> None:
    out, name, _ = new_loop(tmp_path, "runc")
    runc_a.create(genloop_spec_for(IMAGE_ID, out, steps=STEPS), name=name)
    wait_lines(out, 10)
    parts = runc_a.checkpoint(name, tmp_path / "ckpt", leave_running=True)
    elsewhere = RuncRuntime(root=tmp_path / "s", bundles=tmp_path / "b", images=tmp_path / "i")
    reasons = container_reasons(parts.container, elsewhere)
    assert len(reasons) == 1 and IMAGE_ID in reasons[0]
    with pytest.raises(FailedPrecondition, match="not present here"):
        elsewhere.restore(load_parts(parts.directory), name=f"{name}-x")


def test_a_missing_runc_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    rt = RuncRuntime(binary=str(tmp_path / "no-runc"))
    with pytest.raises(Unsupported, match=r"runc: .*no-runc not found"):
        rt.inspect("anything")


def _runc_section(rt: RuncRuntime) -> str:
    root = rt.tool.base_args[1]  # "--root", ROOT
    return (
        '[containers]\ndetect = ["runc"]\n[containers.runc]\n'
        f'root = "{root}"\nbundles = "{rt.bundles}"\nimages = "{rt.images}"\n'
    )


def test_runc_container_checkpointed_by_gpusnapd_restores_on_another_node_bit_exactly(
    runc_a: RuncRuntime, runc_b: RuncRuntime, daemons: Daemons, tmp_path: Path
) -> None:
    steps = 300  # still running when the test looks at the restored container
    out, name, expected = new_loop(tmp_path, "druncc", steps)
    a = start_daemon(daemons, "a", _runc_section(runc_a))
    b = start_daemon(daemons, "b", _runc_section(runc_b))
    runc_a.create(genloop_spec_for(IMAGE_ID, out, steps=steps), name=name)
    wait_lines(out, 30)
    done = cli_json(a, "checkpoint", "--container", name, "--wait")  # runc: detected
    assert done["container"] == {
        "name": name,
        "id": name,
        "runtime": "runc",
        "image_digest": IMAGE_ID,
    }
    assert lines(out) < steps
    # Under a new name: a bundle of node B's own, over its image directory and the rootfs
    # diff (with the old name, runc would restore into node A's bundle, on this one machine).
    restored = cli_json(b, "restore", done["checkpoint_id"], "--name", f"{name}-b", "--wait")
    assert restored["mode"] == "restored", restored
    assert restored["pids"] == list(runc_b.inspect(f"{name}-b").pids)
    assert (runc_b.bundles / f"{name}-b" / "upper").is_dir()
    assert wait_done(out) == expected
