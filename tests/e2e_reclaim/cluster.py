"""Reclaim and migration end to end: real gpusnapd nodes over one moto S3 store (real HTTP on
127.0.0.1), each watching a loopback metadata server, with real CRIU and a real workload.

All "nodes" share this machine's pid namespace (no network namespaces: each would need its own
route to moto, and only loopback is allowed here). So when node A's kill-mode checkpoint kills
the workload, the test — the workload's parent and a child subreaper — must reap it before node
B restores it under the same pids; ``ReclaimWorkload`` does that from a thread the moment the
tree dies. The workload runs for many steps, and the test compares the first N lines of the
restored run with an uninterrupted run of N steps, so nothing depends on how fast the reclaim is.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import daemon_config, workloads
from tests.support.criu import criu_or_skip
from tests.support.daemons import HANG_GUARD, Node, Nodes
from tests.support.moto_server import TEST_REGION, MotoServer
from tests.support.waits import wait_for

WORKLOAD = "tree"
LONG_RUN_STEPS = 100_000  # never finishes during a test; compared by prefix
POLL = 0.2  # watcher and standby poll periods in the daemons under test (seconds)


@dataclass
class ReclaimWorkload:
    """The tree workload with a pid file, reaped from a thread as soon as it dies."""

    w: workloads.Workload
    pid_file: Path
    _reaper: threading.Thread | None = None
    reaped: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.w.pid

    def reap_when_killed(self) -> None:
        """A kill-mode dump kills the tree; free its pids at once (B restores them)."""
        self.w.descendants = workloads.descendants_of(self.w.pid)

        def run() -> None:
            self.w.reap(timeout=HANG_GUARD * 5)
            self.reaped.set()

        self._reaper = threading.Thread(target=run, name="reap-workload", daemon=True)
        self._reaper.start()

    def lines(self) -> list[bytes]:
        return [ln for ln in self.w.output().split(b"\n")[:-1] if ln[:1].isdigit()]

    def check_continues_identically(self, tmp: Path, more: int = 20) -> int:
        """Wait until the (restored) run has ``more`` steps beyond what it had when it was
        reaped, and compare every line so far with an uninterrupted run. Returns N."""
        wait_for("the workload to be reaped", self.reaped.is_set)
        at_dump = len(self.lines())
        n = at_dump + more
        wait_for(f"the restored workload to reach step {n}", lambda: len(self.lines()) >= n)
        ref = workloads.reference_output("tree", tmp / f"ref-{uuid.uuid4().hex[:6]}", steps=n)
        expected = ref.split(b"\n")[:n]
        assert self.lines()[:n] == expected
        return n

    def kill_restored(self) -> None:
        """Kill the restored tree (it runs under the original pids). Called once the nodes
        have stopped: the tree, a restoring daemon's child, was then reparented to us (the
        child subreaper), so we reap it too."""
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            return
        if str(self.w.out_path).encode() not in cmdline:
            return
        tree = [self.pid, *workloads.descendants_of(self.pid)]
        workloads.kill_tree(self.pid)
        for pid in tree:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def workload_section(
    pid_file: Path, *, revision: str = "r1", marker: Path | None = None, extra: str = ""
) -> str:
    """The ``[[workload]]`` every node has; ``revision`` is the model build it runs."""
    return daemon_config.workload_section(
        WORKLOAD,
        pid_file,
        revision=revision,
        marker=marker,
        extra='on_notice = "checkpoint"\n' + extra,
    )


def triggers_section(provider: str, url: str | None = None, **extra: object) -> str:
    keys: dict[str, object] = {
        "provider": provider,
        "poll_interval": POLL,
        "azure_poll_interval": POLL,
        "http_timeout": 1.0,
        "gcp_wait_timeout": 1,
        "max_backoff": 1.0,
        "logind": False,
    }
    if url is not None:
        keys[
            {"aws": "aws_imds_url", "gcp": "gcp_metadata_url", "azure": "azure_metadata_url"}[
                provider
            ]
        ] = url
    keys.update(extra)
    return "[triggers]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())


def migration_section(
    *,
    standby: bool,
    cold_start_after: float = 600.0,
    poll_interval: float = POLL,
    request_ttl: float | None = None,
) -> str:
    ttl = f"request_ttl = {request_ttl}\n" if request_ttl is not None else ""
    return (
        f"[migration]\nstandby = {json.dumps(standby)}\npoll_interval = {poll_interval}\n"
        f"cold_start_after = {cold_start_after}\n{ttl}"
    )


class Cluster:
    """Nodes over one S3 bucket on the moto server (each test gets a fresh bucket)."""

    def __init__(self, nodes: Nodes, moto: MotoServer, bucket: str) -> None:
        self.nodes = nodes
        self.moto = moto
        self.bucket = bucket
        self.prefix = "ckpt"

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def node(self, name: str, config: str, *, endpoint_url: str | None = None) -> Node:
        node = self.nodes.make(name, extra_config=config, store_url=self.url)
        node.write_config(
            f'url = "{self.url}"\nkey_file = "{self.nodes.key_file}"\n'
            f'endpoint_url = "{endpoint_url or self.moto.endpoint_url}"\n'
            f'region = "{TEST_REGION}"\naddressing_style = "path"\n'
            "retry_attempts = 3\nretry_base_delay = 0.05\nretry_max_delay = 0.5\n"
        )
        return node.start()

    def reclaimed(
        self,
        wl: ReclaimWorkload,
        provider: str = "none",
        url: str | None = None,
        *,
        extra: str = "",
        endpoint_url: str | None = None,
    ) -> Node:
        """Node ``a``: runs the workload and watches ``provider`` (its metadata server at
        ``url``); it is the node a notice reclaims."""
        return self.node(
            "a",
            triggers_section(provider, url)
            + migration_section(standby=False)
            + workload_section(wl.pid_file, extra=extra),
            endpoint_url=endpoint_url,
        )

    def standby(
        self,
        name: str,
        wl: ReclaimWorkload,
        *,
        revision: str = "r1",
        marker: Path | None = None,
        cold_start_after: float = 600.0,
        poll_interval: float = POLL,
        request_ttl: float | None = None,
        standby: bool = True,
    ) -> Node:
        """A standby node that watches no cloud and adopts the workload (``revision``: the
        model build it runs; ``marker``: what its cold-start command writes; ``standby=False``:
        a node with the same config that adopts nothing by itself)."""
        return self.node(
            name,
            triggers_section("none")
            + migration_section(
                standby=standby,
                cold_start_after=cold_start_after,
                poll_interval=poll_interval,
                request_ttl=request_ttl,
            )
            + workload_section(wl.pid_file, revision=revision, marker=marker),
        )

    def keys(self, sub: str = "") -> list[str]:
        client = self.moto.client()
        try:
            out: list[str] = []
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}/{sub}"
            )
            for page in pages:
                out += [o["Key"][len(self.prefix) + 1 :] for o in page.get("Contents", [])]
            return out
        finally:
            client.close()


@contextlib.contextmanager
def cluster_of(tmp_path: Path, moto: MotoServer, bucket: str) -> Iterator[Cluster]:
    """Nodes over ``bucket`` (fresh, on ``moto``), all stopped at the end (CRIU and root, or
    a skip)."""
    criu_or_skip()
    nodes = Nodes(tmp_path)
    try:
        yield Cluster(nodes, moto, bucket)
    finally:
        nodes.close()
