"""``[store] trusted_keys``: the daemon accepts manifests signed by the keys it trusts, and
refuses, with the key id, those signed by any other (issue 12: signing keys per node)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.config.file import load_config, parse_config
from gpusnap.daemon.service import DaemonService
from gpusnap.errors import EXIT_INTEGRITY, Corrupt, InvalidArgument, exit_code_for
from gpusnap.storage import export_public_key, generate_signing_key, open_store
from gpusnap.storage.keys import load_signing_key


@pytest.fixture
def other_nodes_checkpoint(tmp_path: Path) -> tuple[Path, str, Path]:
    """A store holding one checkpoint signed by node B; B's public key in ``trusted.d/``."""
    store_url = f"file://{tmp_path / 'store'}"
    key_b = tmp_path / "b.key"
    generate_signing_key(key_b)
    trusted = tmp_path / "trusted.d"
    trusted.mkdir()
    export_public_key(key_b, trusted / "b.pub")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "pages-1.img").write_bytes(b"\x07" * 70_000)
    with open_store(store_url, key_file=key_b, cache_dir=tmp_path / "cache-b") as store:
        pushed = store.push(tree, workload="svc")
    return tmp_path / "store", pushed.checkpoint_id, trusted


def _service(tmp_path: Path, store: Path, trusted: list[str]) -> DaemonService:
    key_a = tmp_path / "a.key"
    if not key_a.exists():
        generate_signing_key(key_a)
    name = f"state-{len(trusted)}"
    config = parse_config(
        {
            "daemon": {"socket": str(tmp_path / f"{name}.sock"), "state_dir": str(tmp_path / name)},
            "store": {"url": f"file://{store}", "key_file": str(key_a), "trusted_keys": trusted},
            "gpu": {"driver": "none"},
        }
    )
    return DaemonService(config)


@pytest.fixture
def node_a(
    tmp_path: Path, other_nodes_checkpoint: tuple[Path, str, Path]
) -> Iterator[Callable[[list[str]], DaemonService]]:
    """Start node A's daemon on the store of ``other_nodes_checkpoint``, trusting the keys
    given; every one started is closed after the test."""
    store = other_nodes_checkpoint[0]
    made: list[DaemonService] = []

    def start(trusted: list[str]) -> DaemonService:
        made.append(_service(tmp_path, store, trusted))
        return made[-1]

    yield start
    for svc in made:
        svc.close()


def test_a_manifest_signed_by_an_untrusted_node_is_refused_with_its_key_id(
    tmp_path: Path,
    other_nodes_checkpoint: tuple[Path, str, Path],
    node_a: Callable[[list[str]], DaemonService],
) -> None:
    _, checkpoint_id, _ = other_nodes_checkpoint
    svc = node_a([])
    with pytest.raises(Corrupt) as info:
        svc.compat(checkpoint_id)
    key_id = load_signing_key(tmp_path / "b.key").key_id
    assert key_id in str(info.value)
    assert "\n" not in str(info.value)
    assert exit_code_for(info.value) == EXIT_INTEGRITY


def test_a_manifest_signed_by_a_trusted_node_is_accepted(
    other_nodes_checkpoint: tuple[Path, str, Path],
    node_a: Callable[[list[str]], DaemonService],
) -> None:
    _, checkpoint_id, trusted = other_nodes_checkpoint
    verdict = node_a([str(trusted)]).compat(checkpoint_id)
    assert verdict.checkpoint_id == checkpoint_id


def test_a_trusted_key_that_is_not_a_key_is_refused_at_load_naming_the_key(
    tmp_path: Path,
) -> None:
    key = tmp_path / "a.key"
    generate_signing_key(key)
    bogus = tmp_path / "bogus.pub"
    bogus.write_text("not a key\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\nkey_file = "{key}"\ntrusted_keys = ["{bogus}"]\n')
    with pytest.raises(InvalidArgument) as info:
        load_config(cfg)
    assert "[store] trusted_keys" in str(info.value)
    assert "\n" not in str(info.value)
