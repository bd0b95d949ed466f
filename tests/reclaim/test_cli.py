"""The trigger CLI commands: parsing, rendering, and an unreachable daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.cli._common import UsageError
from gpusnap.cli.main import build_parser
from gpusnap.cli.trigger_cmds import render_migrations, render_triggers


def test_drill_reclaim_parses_seconds_and_durations() -> None:
    parser = build_parser()
    assert parser.parse_args(["drill", "reclaim", "--deadline", "30"]).deadline == 30.0
    assert parser.parse_args(["drill", "reclaim", "--deadline", "2m"]).deadline == 120.0
    assert parser.parse_args(["drill", "reclaim"]).deadline is None
    with pytest.raises(UsageError, match="deadline must be more than 0 seconds"):
        parser.parse_args(["drill", "reclaim", "--deadline", "0"])


def test_render_triggers_shows_provider_poll_error_and_notice() -> None:
    text = render_triggers(
        {
            "provider": "aws",
            "detail": "provider aws (auto-detected)",
            "watchers": [
                {
                    "name": "aws",
                    "last_poll_at": 1.0,
                    "last_poll_ok": False,
                    "last_error": "timed out after 2 s",
                    "last_notice": {"kind": "reclaim", "event_id": "spot-itn-ab"},
                }
            ],
            "workloads": [
                {
                    "workload": "llm",
                    "on_notice": "checkpoint",
                    "checkpoint_interval": 600,
                    "running": None,
                    "reclaim": {"trigger": "reclaim:aws", "done": True, "committed": True},
                }
            ],
        }
    )
    assert "provider: aws" in text
    assert "timed out after 2 s" in text
    assert "reclaim spot-itn-ab" in text
    assert "reclaim:aws committed" in text


def test_render_migrations() -> None:
    assert render_migrations([]) == "no migrations"
    text = render_migrations(
        [
            {
                "checkpoint_id": "20261130T083000Z-0123456789",
                "status": "claimed",
                "request": {"workload": "llm", "source_node": "a"},
                "claim": {"node_id": "b", "mode": "restore"},
                "outcome": None,
            }
        ]
    )
    assert "20261130T083000Z-0123456789" in text and "b (restore)" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["triggers"], ["migrations"], ["drill", "reclaim"]])
def test_unreachable_daemon_exits_5_with_one_line(command: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpusnap.cli.main",
            "--socket",
            str(tmp_path / "none.sock"),
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 5
    assert proc.stderr.count("\n") == 1 and "cannot reach gpusnapd" in proc.stderr
