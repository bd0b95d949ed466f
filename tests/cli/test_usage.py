"""Usage errors of ``gpusnap`` (what argparse refuses): one line naming the command and its
help, exit 2, the documented JSON object on stdout with ``--json``, and an unknown option
named as such rather than as a missing required argument. Real subprocesses of the CLI; none
of these reach a daemon."""

from __future__ import annotations

import json

import pytest

from tests.cli._cli import Cli


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["checkpoint", "--bogus"],
            "checkpoint: unrecognized argument --bogus (see `gpusnap checkpoint --help`)",
        ),
        (
            ["checkpoint", "--pid", "7", "--bogus=3"],
            "checkpoint: unrecognized argument --bogus=3 (see `gpusnap checkpoint --help`)",
        ),
        (
            ["checkpoint"],
            "checkpoint: one of the arguments --pid --workload --container is required "
            "(see `gpusnap checkpoint --help`)",
        ),
        (
            ["chekpoint"],
            "argument <command>: invalid choice 'chekpoint' (did you mean 'checkpoint'?) "
            "(see `gpusnap --help`)",
        ),
        (
            ["migrations", "withdraw"],
            "migrations withdraw: the following arguments are required: ID "
            "(see `gpusnap migrations withdraw --help`)",
        ),
        (
            ["store", "gc", "--keep-last", "0"],
            "store gc: argument --keep-last: must be at least 1: '0' "
            "(see `gpusnap store gc --help`)",
        ),
    ],
)
def test_a_usage_error_is_one_line_naming_the_command_and_its_help(
    cli: Cli, argv: list[str], line: str
) -> None:
    result = cli(*argv)
    assert result.rc == 2, str(result)
    assert result.err == f"gpusnap: error: {line}\n"
    assert result.out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["checkpoint", "--json", "--bogus"],
        ["--json", "checkpoint"],
        ["show", "--json"],
        ["store", "gc", "--keep-last", "0", "--json"],
    ],
)
def test_json_on_a_usage_error_prints_the_error_object(cli: Cli, argv: list[str]) -> None:
    result = cli(*argv)
    assert result.rc == 2, str(result)
    doc = json.loads(result.out)
    assert doc == {
        "error": result.err.removeprefix("gpusnap: error: ").strip(),
        "kind": "invalid_argument",
        "exit_code": 2,
    }


def test_help_and_version_are_not_errors(cli: Cli) -> None:
    helped = cli("checkpoint", "--help")
    assert helped.rc == 0 and helped.out.startswith("usage: gpusnap checkpoint")
    assert cli("--version").rc == 0
