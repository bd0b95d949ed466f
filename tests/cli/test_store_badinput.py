"""Wrong arguments to ``gpusnap store``: one clear line and the documented exit code."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.storage import generate_signing_key
from tests.cli._cli import Cli, make_cli, write_tree

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INTEGRITY = 4


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


def test_pushing_a_regular_file_says_it_is_not_a_directory(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"x")
    result = cli("store", "push", str(path), "--workload", "w")
    assert result.rc == EXIT_USAGE, str(result)
    assert "not a directory" in result.err


def test_pushing_onto_an_unknown_parent_is_not_found(cli: Cli, tmp_path: Path) -> None:
    image = tmp_path / "image"
    write_tree(image, big=4096)
    result = cli(
        "store", "push", str(image), "--workload", "w", "--parent", "20200101T000000Z-0123456789"
    )
    assert result.rc == EXIT_NOT_FOUND, str(result)


@pytest.mark.parametrize(
    "argv",
    [
        ["store", "ls"],
        ["store", "show", "20200101T000000Z-0123456789"],
        ["store", "verify", "--all"],
        ["store", "pull", "20200101T000000Z-0123456789", "DEST"],
    ],
)
def test_reading_a_mistyped_store_path_creates_nothing(tmp_path: Path, argv: list[str]) -> None:
    missing = tmp_path / "no-such-store"
    cli = make_cli(tmp_path, store_url=f"file://{missing}")
    result = cli(*[str(tmp_path / "dest") if a == "DEST" else a for a in argv])
    assert result.rc == EXIT_NOT_FOUND, str(result)
    assert "no store at" in result.err
    assert not missing.exists()


def test_a_store_url_naming_a_file_says_it_is_not_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"")
    result = make_cli(tmp_path, store_url=f"file://{path}")("store", "ls")
    assert result.rc != 0 and _one_line(result.err)
    assert "not a directory" in result.err


def test_an_unusable_cache_dir_is_one_clear_line(cli: Cli) -> None:
    result = cli("store", "gc", "--dry-run", "--cache-dir", "/proc/nope")
    assert result.rc == EXIT_FAILURE, str(result)
    assert _one_line(result.err) and "/proc" in result.err and "[Errno" not in result.err


def test_ls_with_the_wrong_key_says_what_it_left_out(cli: Cli, tmp_path: Path) -> None:
    image = tmp_path / "image"
    write_tree(image, big=4096)
    cli.push(image, "w")
    other = tmp_path / "other.key"
    generate_signing_key(other)
    result = cli("store", "ls", env={"GPUSNAP_KEY_FILE": str(other)})
    assert result.rc == EXIT_INTEGRITY, str(result)
    assert "1 manifest(s) left out" in result.err and _one_line(result.err)
