"""Real gpusnapd daemons for the container tests, each reaching its own podman storage root.

A daemon is ``tests.support.daemons.Node`` (its own state dir and socket, the CLI driven as a
subprocess; the ``daemons`` fixture of conftest.py makes them); ``podman_section`` gives it the
``[containers]`` tables that point it at one of the ``nodes`` fixture's storage roots, so two
daemons over two roots are two nodes on one machine.
"""

from __future__ import annotations

import json
from typing import Any

from tests.containers.harness import Node
from tests.support.daemons import Node as Daemon
from tests.support.daemons import Nodes as Daemons

__all__ = ["Daemon", "Daemons", "cli_json", "podman_section", "start_daemon"]


def podman_section(node: Node, *, detect: tuple[str, ...] = ("podman",), **extra: Any) -> str:
    """``[containers]`` with ``detect`` and ``[containers.podman]`` for ``node``'s root."""
    options = {**{k: str(v) for k, v in node.options.items()}, **extra}
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())
    return f"[containers]\ndetect = {json.dumps(list(detect))}\n[containers.podman]\n{body}"


def start_daemon(daemons: Daemons, name: str, config: str, **env: str) -> Daemon:
    d = daemons.make(name, extra_config=config)
    d.env.update(env)
    return d.start()


def cli_json(daemon: Daemon, *args: str) -> Any:
    """``gpusnap ARGS --json`` on ``daemon``, which must exit 0."""
    res = daemon.cli(*args, "--json")
    assert res.rc == 0, f"gpusnap {' '.join(args)}: rc {res.rc}: {res.stderr}\n{daemon.log()}"
    return res.json
