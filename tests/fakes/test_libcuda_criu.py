"""Real CRIU on a process of the fake driver: checkpointed, dumped, killed, its node deleted,
restored by CRIU and then onto another node by the driver, its device memory byte for byte.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpusnap.daemon.host.criu import Criu
from tests.fakes import libcuda
from tests.fakes.libcuda import (
    A0,
    B0,
    GIB,
    MIB,
    Spawn,
    checkpoint,
    control,
    free_memory,
    gpu,
    ok,
    one_gpu_node,
    write_node,
)

# -- CRIU ---------------------------------------------------------------------------------------


@pytest.mark.criu
@pytest.mark.timeout(300)
def test_criu_dumps_a_checkpointed_process_and_it_comes_back_on_another_node_byte_for_byte(
    lib: Path, tmp_path: Path, spawn: Spawn, criu: Criu
) -> None:
    root_a = one_gpu_node(tmp_path)
    ea = libcuda.env(lib, root_a)
    eb = libcuda.env(lib, write_node(tmp_path / "node-b", [gpu(0, uuid=B0)]))
    p = spawn(tmp_path / "p", ea, [(0, 6 * MIB), (0, MIB + 3)])
    p.command("async_copy", 0, MIB)  # a stream, and its thread, live through it all
    before = p.command("digest")
    tid = ok(control(ea, [["restore_tid", p.pid]])[0])
    threads = p.threads()
    assert list(threads.values()).count("cuda-stream") == 1
    checkpoint(ea, p.pid)
    # What CRIU will see: nothing of the node held open or mapped, device memory in host memory.
    held = [os.readlink(f) for f in Path(f"/proc/{p.pid}/fd").iterdir()]
    maps = Path(f"/proc/{p.pid}/maps").read_text()
    assert not [h for h in held if h.startswith(str(root_a))] and str(root_a) not in maps

    images = tmp_path / "images"
    dumped = criu.dump(p.pid, images, leave_running=False, log_path=tmp_path / "dump.log")
    assert p.proc.wait(60) == -9  # kill mode: CRIU killed it once dumped
    p.reaped()
    assert dumped.images_bytes > 7 * MIB  # the device bytes travel as ordinary pages
    shutil.rmtree(root_a)  # the node is gone
    restored = criu.restore(
        images, log_path=tmp_path / "restore.log", pidfile=tmp_path / "pid", sibling=True
    )
    assert restored.pid == p.pid
    assert p.threads() == threads  # the restore thread and the stream's came back with it
    res = control(
        eb,
        [
            ["init"],
            ["state", p.pid],
            ["restore_tid", p.pid],
            ["restore", p.pid, [[A0, B0]]],
            ["unlock", p.pid],
            ["state", p.pid],
        ],
    )
    assert [r.get("ok", r.get("error")) for r in res] == [
        None,
        "CHECKPOINTED",
        tid,
        None,
        None,
        "RUNNING",
    ]
    after = p.command("digest")
    assert [a["sha256"] for a in after["allocs"]] == [a["sha256"] for a in before["allocs"]]
    assert all(a["intact"] and a["uuid"] == B0 for a in after["allocs"])
    assert free_memory(eb) == 141 * GIB - 8 * MIB - 3
    p.command("synchronize")
    os.kill(p.pid, 9)
    os.waitpid(p.pid, 0)  # --restore-sibling made it our child
