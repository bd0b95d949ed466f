"""``gpusnap show ID`` through the daemon, and ``gpusnap store show ID`` on the store: each file's
mode and chunk count, the stamp readable (no Python reprs) with exact integers (a file's
``mtime_ns`` in ``--json``), and the process's environment by name only unless ``--show-env``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support import workloads
from tests.support.daemons import Node, Nodes
from tests.support.workloads import Started

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(300)]

SECRET_NAME, SECRET = "GPUSNAP_TEST_API_TOKEN", "s3cr3t-value-9f2c"


def _checkpointed(
    nodes: Nodes, tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch
) -> tuple[Node, str]:
    monkeypatch.setenv(SECRET_NAME, SECRET)  # the workload inherits it
    w = started(workloads.start_counter(tmp_path / "run"), steps=2)
    node = nodes.make("a").start()
    got = node.cli("checkpoint", "--pid", str(w.pid), "--leave-running", "--wait", "--json")
    assert got.rc == 0, got.stderr
    return node, str(got.json["checkpoint_id"])


def _store_show(node: Node, cid: str, *args: str) -> Any:
    return node.cli(
        "store", "show", "--store", node.store_url, "--key-file", str(node.key_file), cid, *args
    )


def test_show_prints_modes_chunks_a_readable_stamp_and_env_names_only(
    nodes: Nodes, tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, cid = _checkpointed(nodes, tmp_path, started, monkeypatch)
    for shown in (node.cli("show", cid), _store_show(node, cid)):
        assert shown.rc == 0, shown.stderr
        text = shown.stdout
        assert "{'" not in text and "[{" not in text  # no Python reprs of the stamp
        assert SECRET not in text
        assert SECRET_NAME in text and "values hidden; --show-env shows them" in text
        files = text[text.index("\nfiles\n") + 1 :].splitlines()[2:]
        assert files, text
        for row in files:  # MODE SIZE CHUNKS PATH, each file of the image
            mode, _size, _unit, chunks, _path = row.split()
            assert len(mode) == 4 and int(mode, 8) & 0o400, row
            assert int(chunks) >= 1, row
        assert "pages-1.img" in text
        assert "MODIFIED" in text  # the files the process had mapped, with their times
    with_env = node.cli("show", cid, "--show-env")
    assert f"{SECRET_NAME}={SECRET}" in with_env.stdout


def test_show_json_keeps_integers_exact_and_hides_env_values(
    nodes: Nodes, tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, cid = _checkpointed(nodes, tmp_path, started, monkeypatch)
    shown = node.cli("show", cid, "--json")
    assert shown.rc == 0, shown.stderr
    m = shown.json
    watched = m["stamp"]["files"]
    assert watched
    for f in watched:  # nanoseconds past 2^53: a double would have rounded them
        assert isinstance(f["mtime_ns"], int), f
        if f["kind"] == "mapped":  # the interpreter and its libraries: unchanged since
            assert f["mtime_ns"] == os.stat(f["path"]).st_mtime_ns, f
    for f in m["files"]:
        assert isinstance(f["mode"], int) and f["mode"] & 0o400, f
        assert f["chunk_count"] >= 1, f
    for part in ("stamp", "spec"):
        launch = m[part]["launch"]
        assert launch["env_hidden"] is True
        assert launch["env"][SECRET_NAME] is None
        assert all(v is None for v in launch["env"].values())
    assert SECRET not in shown.stdout
    # The store's own show says the same of the stamp.
    direct = _store_show(node, cid, "--json").json
    assert direct["stamp"] == m["stamp"]
    revealed = node.cli("show", cid, "--json", "--show-env").json
    assert revealed["stamp"]["launch"]["env"][SECRET_NAME] == SECRET
    assert "env_hidden" not in revealed["stamp"]["launch"]
