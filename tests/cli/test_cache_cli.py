"""``gpusnap cache stats|prune`` and ``gpusnap store pull``'s cache flags, as real subprocesses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli._cli import Cli, tree_of, write_tree


@pytest.fixture
def pushed(cli: Cli, tmp_path: Path) -> str:
    write_tree(tmp_path / "image", big=6 * 1024 * 1024)
    checkpoint: str = cli.push(tmp_path / "image", "w")["checkpoint_id"]
    return checkpoint


def test_a_pull_with_a_cache_dir_fills_it_and_the_next_pull_reads_from_it(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    cache = str(tmp_path / "node-cache")
    first = cli.ok("store", "pull", pushed, str(tmp_path / "a"), "--cache-dir", cache, "--json")
    second = cli.ok("store", "pull", pushed, str(tmp_path / "b"), "--cache-dir", cache, "--json")
    one, two = first.json(), second.json()
    assert one["bytes_cached"] == 0 and one["bytes_fetched"] > 0
    assert two["bytes_fetched"] == 0 and two["bytes_cached"] == one["bytes_fetched"]
    assert tree_of(tmp_path / "b") == tree_of(tmp_path / "image")

    stats = cli.ok("cache", "stats", "--cache-dir", cache, "--json").json()
    assert stats["bytes"] == one["bytes_fetched"]
    assert stats["entries"] == one["chunks_fetched"]
    assert stats["hits"] == two["chunks_cached"] and stats["misses"] == one["chunks_fetched"]
    assert stats["max_bytes"] > 0 and stats["writing"] == 0
    assert [s["store"] for s in stats["stores"]] == [cli.env["GPUSNAP_STORE"]]
    human = cli.ok("cache", "stats", "--cache-dir", cache).out
    assert "held" in human and cli.env["GPUSNAP_STORE"] in human


def test_the_cache_directory_can_come_from_the_environment(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    env = {"GPUSNAP_CACHE_DIR": str(tmp_path / "env-cache")}
    cli.ok("store", "pull", pushed, str(tmp_path / "a"), env=env)
    again = cli.ok("store", "pull", pushed, str(tmp_path / "b"), "--json", env=env).json()
    assert again["bytes_fetched"] == 0
    assert cli.ok("cache", "stats", "--json", env=env).json()["entries"] > 0


def test_no_cache_neither_reads_nor_fills_the_cache(cli: Cli, pushed: str, tmp_path: Path) -> None:
    env = {"GPUSNAP_CACHE_DIR": str(tmp_path / "env-cache")}
    result = cli.ok("store", "pull", pushed, str(tmp_path / "a"), "--no-cache", "--json", env=env)
    assert result.json()["bytes_cached"] == 0
    assert not (tmp_path / "env-cache").exists()


def test_prune_evicts_to_a_target_or_everything(cli: Cli, pushed: str, tmp_path: Path) -> None:
    cache = str(tmp_path / "node-cache")
    cli.ok("store", "pull", pushed, str(tmp_path / "a"), "--cache-dir", cache)
    held = cli.ok("cache", "stats", "--cache-dir", cache, "--json").json()["bytes"]
    pruned = cli.ok("cache", "prune", "--to", "1MiB", "--cache-dir", cache, "--json").json()
    assert pruned["bytes_left"] <= 1024 * 1024
    assert pruned["bytes_freed"] == held - pruned["bytes_left"]
    assert "evicted" in cli.ok("cache", "prune", "--all", "--cache-dir", cache).out
    assert cli.ok("cache", "stats", "--cache-dir", cache, "--json").json()["bytes"] == 0
    # The next pull fetches what was evicted, and is whole.
    cli.ok("store", "pull", pushed, str(tmp_path / "b"), "--cache-dir", cache)
    assert tree_of(tmp_path / "b") == tree_of(tmp_path / "image")


def test_a_corrupt_cached_chunk_costs_a_fetch_not_the_pull(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    cache = tmp_path / "node-cache"
    cli.ok("store", "pull", pushed, str(tmp_path / "a"), "--cache-dir", str(cache))
    for obj in (cache / "objects").rglob("*"):
        if obj.is_file():
            obj.write_bytes(b"GSNC" + bytes(60))  # a header for nothing
    result = cli.ok(
        "store", "pull", pushed, str(tmp_path / "b"), "--cache-dir", str(cache), "--json"
    )
    assert result.json()["bytes_cached"] == 0
    assert tree_of(tmp_path / "b") == tree_of(tmp_path / "image")
    assert cli.ok("cache", "stats", "--cache-dir", str(cache), "--json").json()["dropped"] > 0


def test_a_missing_cache_is_not_found_and_bad_flags_are_usage_errors(
    cli: Cli, tmp_path: Path
) -> None:
    missing = cli("cache", "stats", "--cache-dir", str(tmp_path / "nope"))
    assert missing.rc == 3 and "no chunk cache" in missing.err
    assert not (tmp_path / "nope").exists()
    as_json = cli("cache", "prune", "--all", "--cache-dir", str(tmp_path / "nope"), "--json")
    assert as_json.rc == 3 and as_json.json()["kind"] == "not_found"
    assert cli("cache", "prune", "--cache-dir", str(tmp_path)).rc == 2  # --to or --all
    assert cli("cache", "prune", "--to", "lots").rc == 2
    assert cli("cache", "prune", "--to", "1GiB", "--all").rc == 2


def test_a_cache_directory_others_may_write_to_is_refused_in_one_line(
    cli: Cli, pushed: str, tmp_path: Path
) -> None:
    cache = tmp_path / "node-cache"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    result = cli("store", "pull", pushed, str(tmp_path / "a"), "--cache-dir", str(cache))
    assert result.rc == 1
    assert "writable by no one else" in result.err and len(result.err.splitlines()) == 1
    assert not (tmp_path / "a").exists()
