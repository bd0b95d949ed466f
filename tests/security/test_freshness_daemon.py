"""Freshness through gpusnapd: ``restore --workload W --latest`` refuses a rolled-back store
(exit 4, naming the checkpoint that is gone) and ``--allow-rollback`` restores what is there;
the daemon keeps its high-water marks in its state dir."""

from __future__ import annotations

from pathlib import Path

from tests.cli._cli import Cli, write_tree
from tests.support.daemons import Nodes

EXIT_INTEGRITY = 4


def test_restore_latest_refuses_a_deleted_newest_checkpoint_and_allow_rollback_proceeds(
    nodes: Nodes,
    tmp_path: Path,
) -> None:
    pusher = Cli(
        {
            "GPUSNAP_STORE": f"file://{nodes.store_dir}",
            "GPUSNAP_KEY_FILE": str(nodes.key_file),
            "XDG_CACHE_HOME": str(tmp_path / "pusher-cache"),
        }
    )
    ids = []
    for seed in (1, 2):
        image = tmp_path / f"image-{seed}"
        write_tree(image, seed=seed, big=64 * 1024)
        ids.append(pusher.push(image, "w")["checkpoint_id"])
    older, newest = ids
    (nodes.store_dir / "manifests" / "w" / newest).unlink()
    node = nodes.make("a").start()

    refused = node.cli("restore", "--workload", "w", "--latest", "--wait")
    assert refused.rc == EXIT_INTEGRITY, refused
    assert newest in refused.stderr and "no longer has" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    proceeded = node.cli(
        "restore", "--workload", "w", "--latest", "--allow-rollback", "--wait", "--json"
    )
    assert "no longer has" not in proceeded.stderr, proceeded
    jobs = node.cli("jobs", "--json").json["jobs"]
    restored = [j for j in jobs if j["kind"] == "restore"]
    assert [j["result"].get("checkpoint_id") for j in restored].count(older) == 1, restored
    assert (node.state_dir / "heads.json").exists()

    misuse = node.cli("restore", older, "--allow-rollback")
    assert misuse.rc == 2 and "--allow-rollback goes with" in misuse.stderr, misuse
