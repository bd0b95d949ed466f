"""vLLM's OpenAI server (the CPU build, a tiny model made offline) checkpointed and restored
through gpusnapd: started under ``gpusnap exec``, checkpointed in kill mode with streaming
requests in flight, restored by a second daemon (its own state directory and cache, the same
store) on the same port, and answering the same greedy requests with the same text and token
ids as before; then checkpointed twice more, leave-running, while it serves.

One server start for the module (the slow part: tens of seconds to minutes). Needs
scripts/install-vllm.sh; without it the tests fail saying so.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gate.model_digest import DigestCache
from gpusnap.daemon.host import tmpfsfiles
from tests.engines.vllm.server import (
    PROMPTS,
    Server,
    Stream,
    Streams,
    model_dir,
    python,
    reap,
    tree,
)
from tests.support import workloads
from tests.support.criu import criu_or_skip
from tests.support.daemons import Node, Nodes

log = logging.getLogger(__name__)

# One server for the module: its tests run on one xdist worker (two servers would fight for
# the port and for two cores).
pytestmark = [
    pytest.mark.criu,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.xdist_group("vllm"),
]

LONG = 400  # tokens of a streamed request: it is still generating when the dump comes
JOB_GUARD = 900.0


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """What the tests measured; written to vllm-figures.json and logged at the end."""
    out: dict[str, Any] = {}
    yield out
    path = tmp_path_factory.getbasetemp() / "vllm-figures.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    log.warning("vLLM figures (%s): %s", path, json.dumps(out))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Nodes, Path]]:
    python()  # fails here, saying how to install, when vLLM is not installed
    criu_or_skip()
    workloads.set_child_subreaper(True)  # adopt the tree a kill-mode dump ends, to reap it
    base = tmp_path_factory.mktemp("vllm")
    nodes = Nodes(base)
    try:
        yield nodes, base
    finally:
        nodes.close()
        workloads.set_child_subreaper(False)


@pytest.fixture(scope="module")
def server(env: tuple[Nodes, Path], figures: dict[str, Any]) -> Iterator[Server]:
    _, base = env
    model = model_dir()
    t0 = time.monotonic()
    srv = Server.start(model, base / "server")
    figures["cold_start_to_health_s"] = round(time.monotonic() - t0, 1)
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def reference(server: Server, figures: dict[str, Any]) -> dict[str, Any]:
    """What the uninterrupted server answers: the greedy completions, and the long ones the
    streams will ask for."""
    t0 = time.monotonic()
    short = [server.complete(p) for p in PROMPTS]
    figures["cold_first_requests_s"] = round(time.monotonic() - t0, 2)
    long = [server.complete(p, LONG) for p in PROMPTS]
    return {"short": short, "long": long}


@pytest.fixture(scope="module")
def daemons(env: tuple[Nodes, Path]) -> tuple[Node, Node]:
    nodes, _ = env
    return nodes.make("a").start(), nodes.make("b").start()


def _ok(node: Node, *args: str) -> dict[str, Any]:
    res = node.cli(*args, "--wait", "--json", timeout=JOB_GUARD)
    assert res.rc == 0, f"{args}: {res.stderr}\n{node.log()}"
    out: dict[str, Any] = res.json
    return out


def test_kill_mode_mid_stream_restored_by_another_daemon_answers_identically(
    server: Server, reference: dict[str, Any], daemons: tuple[Node, Node], figures: dict[str, Any]
) -> None:
    a, b = daemons
    streams = Streams(server.port, PROMPTS, LONG)
    streams.wait_generating()
    pids = tree(server.pid)
    assert len(pids) >= 3  # API server, engine core, worker (and the resource tracker)
    shm = sorted({n for h in tmpfsfiles.held_files(server.pid) for n in h.names})
    assert any(n.startswith("/dev/shm/") for n in shm), shm  # vLLM's queues and semaphores
    figures["shm_files"] = len(shm)

    ck = _ok(a, "checkpoint", "--pid", str(server.pid))
    figures["kill_checkpoint"] = {
        k: ck.get(k)
        for k in ("pause_seconds", "dump_seconds", "images_bytes", "bytes_total", "bytes_uploaded")
    }
    assert server.proc is not None and server.proc.wait(120) == -9  # kill mode: gone
    shown = a.cli("show", ck["checkpoint_id"], "--json")
    assert shown.rc == 0, shown.stderr
    engine = shown.json["stamp"]["engine"]
    assert (engine["name"], engine["version"], engine["source"]) == ("vllm", "0.32.0", "probed")
    # The model directory, found after `serve` on the command line, and its files' digest.
    model = shown.json["stamp"]["model"]
    assert (model["dir"], model["dir_source"]) == (str(model_dir()), "probed")
    assert model["digest"] == DigestCache(None).directory_digest(model_dir()).digest
    # As on another node: the server's /dev/shm files are not here; the checkpoint has them.
    for name in shm:
        Path(name).unlink(missing_ok=True)
    reap(pids)
    # Cut mid-generation: what each stream got is the start of the uninterrupted answer, and
    # some were generating when the dump came.
    ended = streams.stop()
    long = dict(zip(PROMPTS, reference["long"], strict=True))
    for s in ended:
        text, ids = long[s.prompt]
        assert text.startswith(s.text) and ids[: len(s.token_ids)] == s.token_ids
    cut = [s for s in ended if not s.done and s.token_ids]
    assert cut, "no stream was in flight at the dump"
    figures["streams_cut_at_dump"] = len(cut)

    t0 = time.monotonic()
    rs = _ok(b, "restore", ck["checkpoint_id"])
    restored = time.monotonic() - t0
    assert rs["mode"] == "restored", rs
    server.proc, server.pid = None, int(rs["pids"][0])
    assert server.pid == pids[0]
    first = server.complete(PROMPTS[0], 1)
    figures["restore_job_s"] = round(restored, 2)
    figures["restore_to_first_token_s"] = round(time.monotonic() - t0, 2)
    figures["restore"] = {k: rs.get(k) for k in rs if k.endswith(("seconds", "bytes"))}
    assert first[1] == reference["short"][0][1][:1]

    again = [server.complete(p) for p in PROMPTS]
    assert again == reference["short"]
    assert all(ids for _, ids in again)  # token ids came back, and compare equal


def test_leave_running_serves_throughout_and_the_second_checkpoint_is_small(
    server: Server, reference: dict[str, Any], daemons: tuple[Node, Node], figures: dict[str, Any]
) -> None:
    _, b = daemons
    stream = Stream(server.port, PROMPTS[1], LONG).start()
    assert stream.first.wait(300)
    answers: list[Any] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            answers.append(server.complete(PROMPTS[2]))

    asker = threading.Thread(target=keep_asking, daemon=True)
    asker.start()
    first = _ok(b, "checkpoint", "--pid", str(server.pid), "--leave-running")
    second = _ok(b, "checkpoint", "--pid", str(server.pid), "--leave-running")
    stop.set()
    asker.join(300)
    assert stream.ended.wait(300)

    # It served during and after both checkpoints, the same answers as ever.
    assert stream.done and stream.error is None
    assert (stream.text, stream.token_ids) == reference["long"][1]
    assert answers and all(ans == reference["short"][2] for ans in answers)
    assert [server.complete(p) for p in PROMPTS] == reference["short"]

    figures["leave_running"] = [
        {k: c.get(k) for k in ("pause_seconds", "bytes_total", "bytes_uploaded")}
        for c in (first, second)
    ]
    assert second["parent"] == first["checkpoint_id"]
    assert second["bytes_uploaded"] < first["bytes_total"] // 4
