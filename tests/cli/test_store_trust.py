"""``gpusnap store`` and trust: keys per node (keygen writes KEY.pub, pubkey prints it),
``--trusted-keys`` / ``GPUSNAP_TRUSTED_KEYS``, rotation, and what verify says it checked; the
store recreated, or a chunk lost, between two pushes, as an operator would meet them."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.cli._cli import Cli, image_tree, make_cli, tree_of, write_tree


def test_keygen_writes_the_public_key_beside_the_private_one_and_pubkey_prints_it(
    tmp_path: Path,
) -> None:
    cli = make_cli(tmp_path)  # keygen --out signing.key, run by make_cli
    key = tmp_path / "signing.key"
    public = tmp_path / "signing.key.pub"
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert key.stat().st_mode & 0o777 == 0o600
    printed = cli.ok("store", "pubkey", str(key))
    assert printed.out.encode() == public.read_bytes()
    from_public = cli.ok("store", "pubkey", str(public), "--json").json()
    assert from_public["public_key"].encode() == public.read_bytes()
    assert len(from_public["key_id"]) == 16

    made = cli.ok("store", "keygen", "--out", str(tmp_path / "node-b.key"), "--json").json()
    assert made["public_key_file"] == str(tmp_path / "node-b.key.pub")
    assert made["key_id"] == cli.ok("store", "pubkey", made["key_file"], "--json").json()["key_id"]
    # A .pub in the way is refused before anything is written.
    (tmp_path / "node-c.key.pub").write_text("someone's\n")
    refused = cli("store", "keygen", "--out", str(tmp_path / "node-c.key"))
    assert refused.rc == 1 and "node-c.key.pub exists" in refused.err
    assert not (tmp_path / "node-c.key").exists()
    missing = cli("store", "pubkey", str(tmp_path / "nope.key"))
    assert missing.rc == 3 and len(missing.err.strip().splitlines()) == 1


def _node(tmp: Path, store: Path, name: str, **env: str) -> Cli:
    """A node: its own key (keygen) and cache, on a shared file:// store."""
    home = tmp / name
    home.mkdir()
    return make_cli(home, store_url=f"file://{store}", **env)


def test_a_checkpoint_signed_by_an_untrusted_key_is_refused_with_exit_4_and_its_key_id(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    a, b = _node(tmp_path, store, "a"), _node(tmp_path, store, "b")
    image = tmp_path / "image"
    write_tree(image, seed=3)
    from_b = b.push(image, "w")["checkpoint_id"]
    b_id = a.ok("store", "pubkey", str(tmp_path / "b" / "signing.key.pub"), "--json").json()
    refused = a("store", "pull", from_b, str(tmp_path / "dest"))
    assert refused.rc == 4, str(refused)
    assert b_id["key_id"] in refused.err and "does not trust" in refused.err
    assert len(refused.err.strip().splitlines()) == 1
    assert not (tmp_path / "dest").exists()
    shown = a("store", "show", from_b, "--json")
    assert shown.rc == 4 and b_id["key_id"] in shown.out

    b_pub = str(tmp_path / "b" / "signing.key.pub")
    a.ok("store", "pull", from_b, str(tmp_path / "dest"), "--trusted-keys", b_pub)
    assert tree_of(tmp_path / "dest") == tree_of(image)
    by_env = a("store", "verify", from_b, env={"GPUSNAP_TRUSTED_KEYS": f"/nonexistent:{b_pub}"})
    assert by_env.rc == 3, "every path named must exist"
    a.ok("store", "verify", from_b, env={"GPUSNAP_TRUSTED_KEYS": str(tmp_path / "b")})


def test_rotating_a_nodes_key_through_the_cli(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    old_key = tmp_path / "signing.key"
    image = tmp_path / "image"
    write_tree(image, seed=5)
    before = cli.push(image, "w")["checkpoint_id"]
    new_key = tmp_path / "signing-2.key"
    cli.ok("store", "keygen", "--out", str(new_key))
    rotated = {"GPUSNAP_KEY_FILE": str(new_key), "GPUSNAP_TRUSTED_KEYS": f"{old_key}.pub"}
    write_tree(image, seed=6)
    after = cli.ok(
        "store", "push", str(image), "--workload", "w", "--parent", before, "--json", env=rotated
    ).json()["checkpoint_id"]
    cli.ok("store", "verify", "--all", env=rotated)
    cli.ok("store", "pull", before, str(tmp_path / "old-restored"), env=rotated)
    # The retired key is dropped: its checkpoint is refused, the new key's is not.
    revoked = {"GPUSNAP_KEY_FILE": str(new_key), "GPUSNAP_TRUSTED_KEYS": ""}
    refused = cli("store", "pull", before, str(tmp_path / "refused"), env=revoked)
    assert refused.rc == 4 and "does not trust" in refused.err
    cli.ok("store", "pull", after, str(tmp_path / "new-restored"), env=revoked)
    assert tree_of(tmp_path / "new-restored") == tree_of(image)
    listing = cli("store", "ls", "--json", env=revoked)
    assert listing.rc == 4 and [c["checkpoint_id"] for c in listing.json()["checkpoints"]] == [
        after
    ]


def test_verify_without_read_data_says_it_checked_chunks_present_not_verified(
    tmp_path: Path,
) -> None:
    cli = make_cli(tmp_path)
    image = image_tree(tmp_path)
    cli.push(image, "w")
    text = cli.ok("store", "verify", "--all")
    assert "chunks present" in text.out and "verified" not in text.out
    as_json = cli.ok("store", "verify", "--all", "--json").json()
    assert as_json["checked"] == "chunks present" and as_json["read_data"] is False
    read = cli.ok("store", "verify", "--all", "--read-data", "--json").json()
    assert read["checked"] == "chunks read and verified"
    assert "chunks read and verified" in cli.ok("store", "verify", "--all", "--read-data").out


def test_a_wiped_store_then_a_push_then_a_pull_works_as_an_operator_expects(
    tmp_path: Path,
) -> None:
    cli = make_cli(tmp_path)
    image = image_tree(tmp_path, seed=8)
    cli.push(image, "w")
    shutil.rmtree(tmp_path / "store")
    again = cli.push(image, "w")
    assert again["chunks_uploaded"] == again["chunks_total"]
    cli.ok("store", "pull", again["checkpoint_id"], str(tmp_path / "dest"))
    assert tree_of(tmp_path / "dest") == tree_of(image)
    cli.ok("store", "verify", "--all", "--read-data")


def test_verify_names_the_damaged_checkpoints_and_the_next_push_repairs_them(
    tmp_path: Path,
) -> None:
    cli = make_cli(tmp_path)
    image = image_tree(tmp_path, seed=9)
    first = cli.push(image, "w")["checkpoint_id"]
    shown = cli.ok("store", "show", first, "--json").json()
    big = max(shown["files"], key=lambda f: f["size"])
    victim = big["chunks"][0][0]
    (tmp_path / "store" / "chunks" / victim[:2] / victim).unlink()
    found = cli("store", "verify", "--all", "--json")
    assert found.rc == 4
    assert found.json()["checkpoints_damaged"] == [first]
    assert found.json()["damaged"] == {first: [victim]}
    text = cli("store", "verify", "--all")
    assert f"damaged checkpoint {first}" in text.out and "forgot 1 chunk" in text.out
    cli.push(image, "w")
    cli.ok("store", "verify", "--all", "--read-data")
    cli.ok("store", "pull", first, str(tmp_path / "dest"))
    assert tree_of(tmp_path / "dest") == tree_of(image)
