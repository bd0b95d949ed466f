"""Per-workload hooks (``daemon/pipelines/hooks.py``): what the config takes, how a hook runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.config.hooks import Hook, WorkloadHooks
from gpusnap.daemon.host import proctree
from gpusnap.daemon.pipelines.hooks import JobHooks, run_hook
from gpusnap.errors import FailedPrecondition
from tests.daemon_gpu.configs import config_error, parse_with
from tests.fakes.libcuda import wait_for


def _workload(hooks: str) -> str:
    return f'[[workload]]\nname = "llm"\nhooks = {hooks}'


def _config(tmp_path: Path, hooks: str) -> Any:
    return parse_with(tmp_path, _workload(hooks))


def test_hooks_are_commands_or_tables_with_their_own_deadline(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        '{ pre_checkpoint = ["/bin/pause", "now"], '
        'post_restore = { command = ["/bin/resume"], timeout_s = 90 }, timeout_s = 5 }',
    )
    hooks = config.workload("llm").hooks
    assert hooks == WorkloadHooks(
        pre_checkpoint=Hook("pre_checkpoint", ("/bin/pause", "now"), 5.0),
        post_restore=Hook("post_restore", ("/bin/resume",), 90.0),
    )


@pytest.mark.parametrize(
    ("hooks", "says"),
    [
        ('{ pre_checkpoint = "pause" }', "key 'pre_checkpoint': must be a command"),
        ("{ pre_checkpoint = [] }", "the command must not be empty"),
        (
            '{ pre_chekpoint = ["x"] }',
            "unknown key 'pre_chekpoint' (did you mean 'pre_checkpoint'?)",
        ),
        ('{ post_thaw = { command = ["x"], timeout = 3 } }', "unknown key 'timeout'"),
        ('{ post_thaw = ["x"], timeout_s = 0 }', "key 'timeout_s': must be at least"),
    ],
)
def test_a_bad_hook_is_a_config_error_naming_the_key(tmp_path: Path, hooks: str, says: str) -> None:
    message = config_error(tmp_path, _workload(hooks))
    assert says in message and "[[workload]]" in message


def test_a_hook_past_its_deadline_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    hook = Hook(
        "post_thaw", ("sh", "-c", f"sleep 600 & echo $! > {pidfile}; echo waiting; wait"), 1.0
    )
    result = run_hook(hook, tmp_path / "hooks.log", {})
    assert result["exit_status"] is None
    assert result["error"] == "did not finish within 1s and was killed"
    assert "waiting" in result["output_tail"]
    child = int(pidfile.read_text())
    wait_for(lambda: not proctree.exists(child), "the hook's child to die")  # a zombie is gone


def test_a_failing_pre_checkpoint_fails_in_one_line_and_lets_the_workload_go_on(
    tmp_path: Path,
) -> None:
    resumed = tmp_path / "resumed"
    hooks = WorkloadHooks(
        pre_checkpoint=Hook("pre_checkpoint", ("sh", "-c", "echo engine busy; exit 3"), 5.0),
        post_thaw=Hook("post_thaw", ("sh", "-c", f'echo "$GPUSNAP_PID" > {resumed}'), 5.0),
    )
    recorded: dict[str, Any] = {}
    job = JobHooks(hooks, workload="llm", job_id="J", logs=tmp_path, record=recorded.update)
    with pytest.raises(FailedPrecondition) as caught:
        job.pre_checkpoint([4242, 4243])
    message = str(caught.value)
    assert message.startswith("pre_checkpoint hook exited with status 3; nothing was frozen")
    assert "engine busy" in message and "\n" not in message
    assert resumed.read_text() == "4242\n"
    assert [(h["hook"], h["exit_status"]) for h in recorded["hooks"]] == [
        ("pre_checkpoint", 3),
        ("post_thaw", 0),
    ]
    log = (tmp_path / "J-hooks.log").read_text()
    assert "--- pre_checkpoint: sh -c" in log and "engine busy" in log
