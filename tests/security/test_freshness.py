"""Freshness and binding through the real CLI (issue 19, item 3): an older checkpoint cannot
pass as the latest (rollback, freeze), a checkpoint copied into another store is refused
(cross-store replay, mix-and-match), and a trusted key signs only within its scope."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.cli._cli import Cli, make_cli, write_tree

EXIT_INTEGRITY = 4


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


def _two_checkpoints(tmp_path: Path, cli: Cli, workload: str = "w") -> tuple[str, str]:
    ids = []
    for seed in (1, 2):
        image = tmp_path / f"image-{seed}"
        write_tree(image, seed=seed, big=256 * 1024)
        ids.append(cli.push(image, workload)["checkpoint_id"])
    return ids[0], ids[1]


def _another_node(tmp_path: Path, name: str) -> Cli:
    """A second node on ``tmp_path/store`` with its own key, trusting the first node's."""
    (tmp_path / name).mkdir()
    return make_cli(
        tmp_path / name,
        store_url=f"file://{tmp_path / 'store'}",
        GPUSNAP_TRUSTED_KEYS=str(tmp_path / "signing.key.pub"),
    )


def _heads(store: Path, workload: str) -> list[Path]:
    return sorted((store / "heads" / workload).iterdir())


def test_deleting_the_newest_manifest_makes_latest_refuse_exit_4_naming_it(
    tmp_path: Path,
) -> None:
    cli = make_cli(tmp_path)
    older, newest = _two_checkpoints(tmp_path, cli)
    assert cli.ok("store", "latest", "--workload", "w").out.strip() == newest
    (tmp_path / "store" / "manifests" / "w" / newest).unlink()

    refused = cli("store", "latest", "--workload", "w")
    assert refused.rc == EXIT_INTEGRITY, str(refused)
    assert newest in refused.err and "no longer has" in refused.err
    assert "--allow-rollback" in refused.err and _one_line(refused.err)
    assert refused.out == ""

    accepted = cli.ok("store", "latest", "--workload", "w", "--allow-rollback", "--json")
    assert accepted.json()["checkpoint_id"] == older
    # The head still names what is gone: every later latest says so again, until a push.
    assert cli("store", "latest", "--workload", "w").rc == EXIT_INTEGRITY
    image = tmp_path / "image-3"
    write_tree(image, seed=3, big=64 * 1024)
    third = cli.push(image, "w")["checkpoint_id"]
    assert cli.ok("store", "latest", "--workload", "w").out.strip() == third


def test_a_head_older_than_the_nodes_high_water_mark_is_refused(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    older, newest = _two_checkpoints(tmp_path, cli)
    store = tmp_path / "store"
    first_head, second_head = _heads(store, "w")
    assert second_head.name == "0000000000000002"
    assert cli.ok("store", "latest", "--workload", "w").out.strip() == newest

    # A consistent rollback: the newest manifest and its head gone, an older signed head in
    # place of the newest one (copied over it).
    (store / "manifests" / "w" / newest).unlink()
    shutil.copyfile(first_head, second_head)
    refused = cli("store", "latest", "--workload", "w")
    assert refused.rc == EXIT_INTEGRITY, str(refused)
    assert "older than sequence 2" in refused.err and newest in refused.err
    assert _one_line(refused.err)

    second_head.unlink()  # just the older head, nothing out of place: still older than seen
    refused = cli("store", "latest", "--workload", "w")
    assert refused.rc == EXIT_INTEGRITY and "sequence 1" in refused.err, str(refused)

    # Another node, which never saw sequence 2, cannot tell (what a mark is for).
    other = _another_node(tmp_path, "other")
    assert other.ok("store", "latest", "--workload", "w").out.strip() == older
    # --allow-rollback lowers this node's mark to what the store holds.
    assert cli.ok("store", "latest", "--workload", "w", "--allow-rollback").out.strip() == older
    assert cli.ok("store", "latest", "--workload", "w").out.strip() == older


def test_all_heads_deleted_after_the_node_saw_one_is_refused(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    _older, newest = _two_checkpoints(tmp_path, cli)
    cli.ok("store", "latest", "--workload", "w")
    shutil.rmtree(tmp_path / "store" / "heads")
    refused = cli("store", "latest", "--workload", "w")
    assert refused.rc == EXIT_INTEGRITY, str(refused)
    assert "no head record of w" in refused.err and newest in refused.err


def test_a_store_without_head_records_keeps_working_and_says_so(tmp_path: Path) -> None:
    """A store written before head records: latest is the newest manifest, with a note."""
    cli = make_cli(tmp_path)
    _older, newest = _two_checkpoints(tmp_path, cli)
    shutil.rmtree(tmp_path / "store" / "heads")
    fresh = _another_node(tmp_path, "fresh-node")
    noted = fresh("store", "latest", "--workload", "w")
    assert noted.rc == 0 and noted.out.strip() == newest
    assert "has no head record" in noted.err and "without rollback protection" in noted.err


def test_a_manifest_and_its_chunks_copied_into_another_store_are_refused(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    image = tmp_path / "image"
    write_tree(image, seed=5, big=256 * 1024)
    first = tmp_path / "store"
    second = tmp_path / "second"
    pushed = cli.push(image, "w")
    own = cli.push(image, "w", "--store", f"file://{second}")
    assert pushed["store_id"] != own["store_id"]
    replayed = pushed["checkpoint_id"]
    shutil.copyfile(first / "manifests" / "w" / replayed, second / "manifests" / "w" / replayed)
    shutil.copytree(first / "chunks", second / "chunks", dirs_exist_ok=True)

    into_second = {"GPUSNAP_STORE": f"file://{second}"}
    for args in (("pull", replayed, str(tmp_path / "dest")), ("show", replayed)):
        refused = cli("store", *args, env=into_second)
        assert refused.rc == EXIT_INTEGRITY, str(refused)
        assert _one_line(refused.err), refused.err
        assert pushed["store_id"] in refused.err and own["store_id"] in refused.err
    assert not (tmp_path / "dest").exists()
    listing = cli("store", "ls", "--json", env=into_second)
    assert listing.rc == EXIT_INTEGRITY
    assert [c["checkpoint_id"] for c in listing.json()["checkpoints"]] == [own["checkpoint_id"]]

    # The head too: the first store's head copied over the second's is refused.
    shutil.copyfile(
        first / "heads" / "w" / "0000000000000001", second / "heads" / "w" / "0000000000000001"
    )
    refused = cli("store", "latest", "--workload", "w", env=into_second)
    assert refused.rc == EXIT_INTEGRITY, str(refused)
    assert pushed["store_id"] in refused.err and own["store_id"] in refused.err
    # The original store still serves it.
    cli.ok("store", "pull", replayed, str(tmp_path / "dest"))


def test_a_key_scoped_to_workload_a_cannot_sign_workload_b(tmp_path: Path) -> None:
    a, b = make_cli(tmp_path), _another_node(tmp_path, "b")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copyfile(tmp_path / "b" / "signing.key.pub", trusted / "node-b.pub")
    (trusted / "node-b.pub.scope").write_text("# node b runs workload a only\nworkloads = a\n")
    image = tmp_path / "image"
    write_tree(image, seed=7, big=64 * 1024)
    in_scope = b.push(image, "a")["checkpoint_id"]
    outside = b.push(image, "b")["checkpoint_id"]
    trust = {"GPUSNAP_TRUSTED_KEYS": str(trusted)}

    a.ok("store", "pull", in_scope, str(tmp_path / "dest-a"), env=trust)
    refused = a("store", "pull", outside, str(tmp_path / "dest-b"), env=trust)
    assert refused.rc == EXIT_INTEGRITY, str(refused)
    assert "workload b is not in its scope (workloads=a)" in refused.err
    assert _one_line(refused.err)
    assert not (tmp_path / "dest-b").exists()
    latest = a("store", "latest", "--workload", "b", env=trust)
    assert latest.rc == EXIT_INTEGRITY, str(latest)
    assert a.ok("store", "latest", "--workload", "a", env=trust).out.strip() == in_scope

    # Unscoped (the sidecar removed), the same key signs any workload again; its own node
    # never limits itself.
    (trusted / "node-b.pub.scope").unlink()
    a.ok("store", "pull", outside, str(tmp_path / "dest-b"), env=trust)
    b.ok("store", "pull", outside, str(tmp_path / "dest-b-own"))


def test_a_malformed_scope_file_is_a_one_line_usage_error(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copyfile(tmp_path / "signing.key.pub", trusted / "k.pub")
    (trusted / "k.pub.scope").write_text("workload = a\n")  # not "workloads"
    bad = cli("store", "ls", "--trusted-keys", str(trusted))
    assert bad.rc == 2, str(bad)
    assert "k.pub.scope line 1" in bad.err and _one_line(bad.err)
