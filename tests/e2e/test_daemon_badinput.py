"""The daemon against bad input: an unverified store, processes no checkpoint can capture,
state dirs it cannot use. Each is one line, a documented exit code, and nothing run or lost."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli._cli import write_tree
from tests.support.daemons import BIN, Node, Nodes, gpusnapd

EXIT_USAGE = 2
REFUSAL = "manifest authenticity is not verified ([store] verify = false)"


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


def _push_unsigned(nodes: Nodes, tmp_path: Path, workload: str) -> str:
    """A checkpoint with no signature at all, as anyone who can write to the store makes one."""
    image = tmp_path / "image"
    write_tree(image, big=64 * 1024)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSNAP_")}
    proc = subprocess.run(
        [
            str(BIN / "gpusnap"),
            "store",
            "push",
            str(image),
            "--workload",
            workload,
            "--store",
            f"file://{nodes.store_dir}",
            "--insecure-skip-verify",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    cid: str = json.loads(proc.stdout)["checkpoint_id"]
    return cid


def _unverified_node(nodes: Nodes, store_section: str) -> Node:
    node = nodes.make("a")
    node.write_config(store_section.format(store=nodes.store_dir, key=nodes.key_file))
    return node.start()


@pytest.mark.parametrize(
    "store_section",
    [
        'url = "file://{store}"\nkey_file = "{key}"\nverify = false\n',
        'url = "file://{store}"\nverify = false\n',
    ],
    ids=["with-a-key", "without-a-key"],
)
def test_a_daemon_that_does_not_verify_manifests_never_restores_or_cold_starts_from_them(
    nodes: Nodes, tmp_path: Path, store_section: str
) -> None:
    node = _unverified_node(nodes, store_section)
    assert "[store] verify = false: manifest signatures are NOT checked" in node.log()
    cid = _push_unsigned(nodes, tmp_path, "victim")
    for args in (
        ("restore", cid, "--wait"),
        ("restore", "--workload", "victim", "--latest", "--wait"),
        ("compat", cid),
    ):
        result = node.cli(*args)
        assert result.rc == 1, result
        assert _one_line(result.stderr), result.stderr
        assert REFUSAL in result.stderr, result.stderr
    jobs = node.cli("jobs", "--json")
    assert jobs.rc == 0, jobs
    assert [j for j in jobs.json["jobs"] if j["kind"] == "restore"] == [], "a restore job ran"


def test_a_kernel_thread_is_refused_as_one(nodes: Nodes) -> None:
    kthreads = [
        pid
        for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
        if _is_kernel_thread(pid)
    ]
    if not kthreads:
        pytest.skip("no kernel thread visible in this pid namespace")
    node = nodes.make("a").start()
    result = node.cli("checkpoint", "--pid", str(kthreads[0]), "--leave-running")
    assert result.rc == EXIT_USAGE, result
    assert "is a kernel thread" in result.stderr and "no such process" not in result.stderr
    assert _one_line(result.stderr)


def test_init_is_refused_with_the_reason_not_with_advice_to_run_as_root(nodes: Nodes) -> None:
    node = nodes.make("a").start()
    result = node.cli("checkpoint", "--pid", "1", "--leave-running")
    assert result.rc == EXIT_USAGE, result
    assert "does not checkpoint PID 1" in result.stderr
    assert "run as root" not in result.stderr
    assert _one_line(result.stderr)


@pytest.mark.parametrize("kind", ["a-file", "under-a-file"])
def test_a_state_dir_that_cannot_be_used_is_a_config_error_naming_the_key(
    nodes: Nodes, tmp_path: Path, kind: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    node = nodes.make("a")
    node.write_config()
    state_dir = afile if kind == "a-file" else afile / "state"
    text = node.config_path.read_text().replace(str(node.state_dir), str(state_dir))
    node.config_path.write_text(text)
    proc = gpusnapd("--config", str(node.config_path))
    assert proc.returncode == EXIT_USAGE, proc
    assert "[daemon] state_dir" in proc.stderr and "Errno" not in proc.stderr
    assert _one_line(proc.stderr), proc.stderr
    assert afile.read_text() == "not a directory\n"


def _is_kernel_thread(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return bool(int(stat.rsplit(")", 1)[1].split()[6]) & 0x00200000)
