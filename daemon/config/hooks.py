"""Per-workload hooks as the config gives them: ``[[workload]] hooks``
(``pipelines/hooks.py`` runs them).

Kept apart from the running so that ``config`` imports no process handling.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusnap.daemon.config.table import Table
from gpusnap.errors import InvalidArgument

HOOK_NAMES = ("pre_checkpoint", "post_thaw", "post_restore")
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Hook:
    name: str
    command: tuple[str, ...]
    timeout_s: float


@dataclass(frozen=True)
class WorkloadHooks:
    """A workload's hooks (``[[workload]] hooks``), by name; absent ones are None."""

    pre_checkpoint: Hook | None = None
    post_thaw: Hook | None = None
    post_restore: Hook | None = None

    def get(self, name: str) -> Hook | None:
        hook: Hook | None = getattr(self, name)
        return hook


def parse_hooks(workload: Table) -> WorkloadHooks | None:
    """The ``hooks`` key of a ``[[workload]]`` table, checked; None when it has none."""
    if workload.get("hooks") is None:
        return None
    t: Table = workload.table("hooks")
    default = t.number("timeout_s", minimum=0.001) or DEFAULT_TIMEOUT_S
    found: dict[str, Hook] = {}
    for name in HOOK_NAMES:
        raw = t.get(name)
        if raw is None:
            continue
        if isinstance(raw, dict):
            sub: Table = t.table(name)
            command = sub.string_list("command", required=True) or []
            timeout = sub.number("timeout_s", minimum=0.001) or default
            sub.done()
        elif isinstance(raw, list):
            command, timeout = t.string_list(name) or [], default
        else:
            raise t.bad(name, 'must be a command ["prog", "arg", ...] or { command, timeout_s }')
        if not command or not command[0]:
            raise InvalidArgument(f"{t.where}: key '{name}': the command must not be empty")
        found[name] = Hook(name, tuple(command), timeout)
    t.done()
    return WorkloadHooks(**found)
