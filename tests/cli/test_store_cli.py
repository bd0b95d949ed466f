"""``gpusnap store …`` end to end: real subprocesses of the CLI on a real file:// store."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import stat
import subprocess
from pathlib import Path

import pytest

from tests.cli._cli import (
    CONSOLE_SCRIPT,
    GPUSNAP,
    UNKNOWN_ID,
    Cli,
    make_cli,
    tree_of,
    write_tree,
)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    root = tmp_path / "image"
    write_tree(root)
    return root


def test_push_pull_round_trip_restores_identical_files_and_modes(
    cli: Cli, image: Path, tmp_path: Path
) -> None:
    pushed = cli.push(image, "llama")
    for field in ("checkpoint_id", "bytes_total", "bytes_uploaded", "chunks_total"):
        assert field in pushed
    assert {"chunks_uploaded", "seconds"} <= set(pushed)
    assert pushed["bytes_total"] == sum(len(b) for b in tree_of(image).values())
    assert pushed["chunks_uploaded"] >= 1

    dest = tmp_path / "restored"
    pulled = cli.ok("store", "pull", pushed["checkpoint_id"], str(dest), "--json").json()
    assert isinstance(pulled, dict)
    assert tree_of(dest) == tree_of(image)
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    assert (dest / "empty").exists()


def test_push_without_json_prints_only_the_checkpoint_id(cli: Cli, image: Path) -> None:
    result = cli.ok("store", "push", str(image), "--workload", "llama")
    checkpoint_id = result.out.strip()
    assert result.out == checkpoint_id + "\n"
    assert cli.ids() == [checkpoint_id]


def test_console_script_is_installed_and_runs(tmp_path: Path) -> None:
    assert CONSOLE_SCRIPT.exists(), "run: .venv/bin/pip install -e '.[dev]'"
    proc = subprocess.run(
        [str(CONSOLE_SCRIPT), "store", "keygen", "--out", str(tmp_path / "k")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "k").exists()


def test_second_push_of_same_tree_uploads_nothing_new(cli: Cli, image: Path) -> None:
    first = cli.push(image, "llama")
    second = cli.push(image, "llama", "--parent", first["checkpoint_id"])
    assert second["checkpoint_id"] != first["checkpoint_id"]
    assert second["chunks_uploaded"] == 0
    assert second["bytes_uploaded"] == 0
    assert second["bytes_total"] == first["bytes_total"]
    shown = cli.ok("store", "show", second["checkpoint_id"], "--json").json()
    assert shown["parent"] == first["checkpoint_id"]


def test_ls_lists_newest_first_and_filters_by_workload(cli: Cli, image: Path) -> None:
    a = cli.push(image, "alpha")["checkpoint_id"]
    b = cli.push(image, "beta")["checkpoint_id"]
    assert cli.ids() == [b, a]
    assert cli.ids("--workload", "alpha") == [a]
    assert cli.ids("--workload", "nobody") == []

    table = cli.ok("store", "ls").out.splitlines()
    assert table[0].split() == ["ID", "WORKLOAD", "CREATED", "SIZE", "FILES"]
    assert table[1].split()[:2] == [b, "beta"]
    assert table[1].split()[-1] == "5"  # five files in the image


def test_show_prints_a_summary_and_json_prints_the_whole_manifest(cli: Cli, image: Path) -> None:
    checkpoint_id = cli.push(image, "llama")["checkpoint_id"]
    text = cli.ok("store", "show", checkpoint_id).out
    assert checkpoint_id in text
    assert "llama" in text
    assert "sub/dir/pages-1.img" in text

    manifest = cli.ok("store", "show", checkpoint_id, "--json").json()
    assert manifest["checkpoint_id"] == checkpoint_id
    assert manifest["workload"] == "llama"
    assert sorted(f["path"] for f in manifest["files"]) == sorted(tree_of(image))


def test_verify_passes_on_a_healthy_store(cli: Cli, image: Path) -> None:
    checkpoint_id = cli.push(image, "llama")["checkpoint_id"]
    cli.ok("store", "verify", checkpoint_id)
    cli.ok("store", "verify", "--all")
    report = cli.ok("store", "verify", "--all", "--read-data", "--json").json()
    assert report.get("problems", []) == []


def test_gc_keep_last_removes_older_checkpoints_and_dry_run_removes_nothing(
    cli: Cli, image: Path, tmp_path: Path
) -> None:
    old = cli.push(image, "llama")["checkpoint_id"]
    (image / "sub/dir/pages-1.img").write_bytes(os.urandom(1024 * 1024))
    new = cli.push(image, "llama")["checkpoint_id"]

    cli.ok("store", "gc", "--keep-last", "1", "--grace", "0s", "--dry-run", "--json")
    assert cli.ids() == [new, old]

    report = cli.ok("store", "gc", "--keep-last", "1", "--grace", "0s", "--json").json()
    assert isinstance(report, dict)
    assert cli.ids() == [new]
    cli.ok("store", "verify", "--all", "--read-data")
    dest = tmp_path / "after-gc"
    cli.ok("store", "pull", new, str(dest))
    assert tree_of(dest) == tree_of(image)


@pytest.mark.parametrize("grace", ["0s", "90s", "30m", "2h", "1d", "1h30m"])
def test_gc_accepts_documented_durations(cli: Cli, grace: str) -> None:
    cli.ok("store", "gc", "--grace", grace, "--dry-run")


@pytest.mark.parametrize(
    "argv",
    [
        ["store", "push", "--no-such-flag"],
        ["store", "gc", "--grace", "5x"],
        ["store", "gc", "--grace", "10"],
        ["store", "gc", "--grace", "-1h"],
        ["store", "gc", "--keep-last", "0"],
        ["store", "push", "."],  # --workload missing
        ["store", "verify"],  # neither ID nor --all
        ["store"],
        ["no-such-command"],
    ],
)
def test_usage_errors_exit_2_in_one_line_that_says_where_help_is(cli: Cli, argv: list[str]) -> None:
    result = cli(*argv)
    assert result.rc == 2, str(result)
    (line,) = result.err.splitlines()
    assert line.startswith("gpusnap: error: ") and line.endswith(" --help`)"), line
    assert "Traceback" not in result.err and result.out == ""


def test_unknown_checkpoint_exits_3(cli: Cli, tmp_path: Path) -> None:
    for argv in (
        ["store", "show", UNKNOWN_ID],
        ["store", "pull", UNKNOWN_ID, str(tmp_path / "dest")],
        ["store", "verify", UNKNOWN_ID],
    ):
        result = cli(*argv)
        assert result.rc == 3, str(result)
        assert result.err.startswith("gpusnap: error: ")
        assert len(result.err.strip().splitlines()) == 1
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


def test_json_errors_carry_kind_and_exit_code_on_stdout(cli: Cli) -> None:
    result = cli("store", "show", UNKNOWN_ID, "--json")
    assert result.rc == 3
    assert json.loads(result.out) == {
        "error": json.loads(result.out)["error"],
        "kind": "not_found",
        "exit_code": 3,
    }


def test_push_of_missing_directory_exits_3(cli: Cli, tmp_path: Path) -> None:
    result = cli("store", "push", str(tmp_path / "nope"), "--workload", "w")
    assert result.rc == 3
    assert "nope" in result.err


def test_bad_store_url_is_a_one_line_error(cli: Cli) -> None:
    result = cli("store", "ls", "--store", "ftp://somewhere/x")
    assert result.rc == 2, str(result)
    assert len(result.err.strip().splitlines()) == 1


def test_keygen_makes_private_keys_and_refuses_to_overwrite(tmp_path: Path) -> None:
    cli = Cli({})
    key = tmp_path / "sign.key"
    enc = tmp_path / "enc.key"
    cli.ok("store", "keygen", "--out", str(key))
    cli.ok("store", "keygen", "--out", str(enc), "--encryption")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(enc.stat().st_mode) == 0o600
    before = key.read_bytes()
    again = cli("store", "keygen", "--out", str(key))
    assert again.rc != 0
    assert "exists" in again.err
    assert key.read_bytes() == before


def test_encrypted_store_round_trip_and_key_needed_to_read(tmp_path: Path, image: Path) -> None:
    enc = tmp_path / "enc.key"
    Cli({}).ok("store", "keygen", "--out", str(enc), "--encryption")
    cli = make_cli(tmp_path, GPUSNAP_ENCRYPTION_KEY_FILE=str(enc))
    checkpoint_id = cli.push(image, "secret")["checkpoint_id"]
    dest = tmp_path / "dest"
    cli.ok("store", "pull", checkpoint_id, str(dest))
    assert tree_of(dest) == tree_of(image)

    # Chunk objects do not carry the plaintext.
    needle = (image / "sub/dir/pages-1.img").read_bytes()[:64]
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file():
            assert needle not in path.read_bytes()

    without_key = cli(
        "store",
        "pull",
        checkpoint_id,
        str(tmp_path / "dest2"),
        env={"GPUSNAP_ENCRYPTION_KEY_FILE": ""},
    )
    assert without_key.rc != 0
    assert len(without_key.err.strip().splitlines()) == 1


def test_manifest_signed_by_another_key_is_refused_unless_verification_is_off(
    cli: Cli, image: Path, tmp_path: Path
) -> None:
    checkpoint_id = cli.push(image, "llama")["checkpoint_id"]
    other = tmp_path / "other.key"
    cli.ok("store", "keygen", "--out", str(other))
    refused = cli("store", "show", checkpoint_id, "--key-file", str(other))
    assert refused.rc == 4, str(refused)
    shown = cli.ok(
        "store", "show", checkpoint_id, "--key-file", str(other), "--insecure-skip-verify"
    )
    assert checkpoint_id in shown.out


def _run_on_pty(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run with stderr on a pseudo-terminal; return (exit code, what the terminal saw)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL
        )
        os.close(slave)
        seen = b""
        while True:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                seen += data
            elif proc.poll() is not None:
                break
        assert proc.stdout is not None
        proc.stdout.read()
        proc.stdout.close()
        return proc.wait(), seen.decode(errors="replace")
    finally:
        os.close(master)


def test_push_and_pull_show_a_progress_bar_on_a_terminal_only(cli: Cli, tmp_path: Path) -> None:
    image = tmp_path / "big"
    write_tree(image, big=24 * 1024 * 1024)
    rc, terminal = _run_on_pty(
        [*GPUSNAP, "store", "push", str(image), "--workload", "w"], cli.environ()
    )
    assert rc == 0, terminal
    assert "store push" in terminal and "[" in terminal
    assert "100.0%" in terminal
    # A rate on the line; the frames drawn mid-push (if the push outlasts the redraw interval:
    # on a fast disk it may not) carry an ETA, the final one the time taken
    # (tests/cli/test_progress.py shows both on a clock of its own).
    assert "MiB/s" in terminal and re.search(r"100\.0%.* in +[0-9:.]+", terminal), terminal
    assert "MB/s" not in terminal  # one unit system: binary sizes and rates

    piped = cli.ok("store", "push", str(image), "--workload", "w")
    assert "\r" not in piped.err and "%" not in piped.err
    # The summary still goes to stderr when piped (stdout is the id, for scripts).
    assert piped.err.startswith("pushed 24.3 MiB in 14 chunks; uploaded "), piped.err
    assert piped.out.strip() and "\n" not in piped.out.strip()
    rc, terminal = _run_on_pty(
        [*GPUSNAP, "store", "pull", piped.out.strip(), str(tmp_path / "d"), "--json"],
        cli.environ(),
    )
    assert rc == 0, terminal
    assert "pull [" not in terminal  # --json: no bar even on a terminal
