"""The container keys of gpusnapd's config: ``[containers]``, ``[containers.<runtime>]`` and a
``[[workload]]``'s ``container`` and ``runtime``; each problem is one line naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.config.file import parse_config
from gpusnap.daemon.containers import PodmanRuntime, RuntimeSet
from tests.support.config_errors import STORE, config_error


def test_runtime_options_become_each_runtimes_own_arguments() -> None:
    cfg = parse_config(
        {
            "store": STORE,
            "containers": {
                "detect": ["runc", "podman"],
                "podman": {
                    "root": "/srv/podman",
                    "runroot": "/run/p",
                    "runtime_root": "/run/p-runc",
                    "cgroup_manager": "cgroupfs",
                    "events_backend": "file",
                    "timeout": 120,
                },
                "containerd": {"address": "/run/c.sock", "namespace": "k8s.io"},
            },
            "workload": [{"name": "llm", "container": "llm-0", "runtime": "podman"}],
        }
    )
    assert cfg.containers.detect == ("runc", "podman")
    podman = cfg.containers.options["podman"]
    assert podman["root"] == Path("/srv/podman") and podman["timeout"] == 120.0
    assert cfg.containers.options["containerd"]["namespace"] == "k8s.io"
    (w,) = cfg.workloads
    assert (w.container, w.runtime, w.pid_file) == ("llm-0", "podman", None)
    # The node's runtimes are made from exactly these options, once each.
    runtimes = RuntimeSet(cfg.containers.options, detect=cfg.containers.detect)
    rt = runtimes.get("podman")
    assert isinstance(rt, PodmanRuntime) and rt is runtimes.get("podman")
    assert ["--root", "/srv/podman"] == rt.tool.base_args[2:4]
    assert "root=/run/p-runc" in rt.tool.base_args


def test_without_a_containers_table_every_runtime_is_detected_with_its_defaults() -> None:
    cfg = parse_config({"store": STORE})
    assert cfg.containers.detect == ("podman", "runc", "containerd")
    assert dict(cfg.containers.options) == {}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"containers": {"podman": {"rot": "/x"}}},
            "config: [containers] podman: unknown key 'rot' (did you mean 'root'?)",
        ),
        (
            {"containers": {"podman": {"root": "relative"}}},
            "config: [containers] podman: key 'root': must be an absolute path",
        ),
        (
            {"containers": {"podman": {"runroot": "/" + "r" * 60}}},
            "key 'runroot': podman refuses a runroot longer than 50 characters",
        ),
        (
            {"containers": {"podman": {"cgroup_manager": "cgroupv3"}}},
            "key 'cgroup_manager': must be one of systemd, cgroupfs",
        ),
        ({"containers": {"docker": {}}}, "config: [containers]: unknown key 'docker'"),
        ({"containers": {"detect": ["docker"]}}, "key 'detect': must list runtimes among"),
        ({"containers": {"detect": ["runc", "runc"]}}, "each once"),
        (
            {"workload": [{"name": "a", "runtime": "podman"}]},
            "key 'runtime': goes with 'container'",
        ),
        (
            {"workload": [{"name": "a", "container": "c", "runtime": "docker"}]},
            "key 'runtime': must be one of podman, runc, containerd",
        ),
        (
            {"workload": [{"name": "a", "container": "c", "pid_file": "/run/a.pid"}]},
            "'match', 'container' (got pid_file, container)",
        ),
    ],
)
def test_a_bad_container_key_is_one_line_naming_it(data: dict[str, Any], expected: str) -> None:
    assert expected in config_error(data)
