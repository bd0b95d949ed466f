"""The fake driver's CUDA 13.4 custom storage: the target's device memory mapped into the
caller, copied out and back by the caller, completed with cuCheckpointOperationComplete.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.fakes import libcuda
from tests.fakes.libcuda import Spawn, control, err, free_memory, ok, wait_for
from tests.fakes.libcuda.nodes import A0, B0, B1, GIB, MIB, gpu, write_node

# -- custom storage (CUDA 13.4) ----------------------------------------------------------------


def content(seed: int, index: int, size: int) -> bytes:
    """What target.py wrote into its allocation ``index``."""
    return random.Random(f"{seed}-{index}").randbytes(size)


def test_custom_storage_moves_device_memory_through_the_caller_byte_for_byte(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    cs = {"custom_storage": True, "driver_version": 13040}
    a1 = gpu(1)["uuid"]
    ea = libcuda.env(lib, write_node(tmp_path / "a", [gpu(0), gpu(1)], **cs))  # type: ignore[arg-type]
    eb = libcuda.env(lib, write_node(tmp_path / "b", [gpu(0, uuid=B0), gpu(1, uuid=B1)], **cs))  # type: ignore[arg-type]
    allocs = [(0, 2 * MIB), (1, MIB), (0, 3 * MIB + 17)]
    p = spawn(tmp_path / "p", ea, allocs, seed=7)
    before = p.command("digest")
    saved = tmp_path / "saved"
    saved.mkdir()
    res = control(
        ea,
        [
            ["init"],
            ["retain", 0],
            ["retain", 1],
            ["lock", p.pid, 0],
            ["cs_checkpoint", p.pid, str(saved)],
            ["state", p.pid],
            ["restore", p.pid, None],  # from host: there is no host copy
        ],
    )
    mapped = ok(res[4])
    assert [(m["uuid"], m["size"]) for m in mapped] == [(A0, 5 * MIB + 17), (a1, MIB)]
    assert ok(res[5]) == "CHECKPOINTED"
    assert err(res[6]) == "CUDA_ERROR_ILLEGAL_STATE"
    # One contiguous range per GPU: its allocations in address order.
    by_gpu: dict[int, list[tuple[int, bytes]]] = {}
    for i, ((o, n), ptr) in enumerate(zip(allocs, p.info["pointers"], strict=True)):
        by_gpu.setdefault(o, []).append((ptr, content(7, i, n)))
    for o, uuid in ((0, A0), (1, a1)):
        assert (saved / f"{uuid}.bin").read_bytes() == b"".join(c for _, c in sorted(by_gpu[o]))
    assert [free_memory(ea, i) for i in (0, 1)] == [141 * GIB] * 2

    res = control(
        eb,
        [
            ["init"],
            ["retain", 0],
            ["retain", 1],
            ["cs_restore", p.pid, [[A0, B1], [a1, B0]], str(saved)],
            ["state", p.pid],
            ["unlock", p.pid],
        ],
    )
    assert [m["uuid"] for m in ok(res[3])] == [B1, B0]  # in the order of its own devices
    assert ok(res[4]) == "LOCKED" and "ok" in res[5]
    after = p.command("digest")
    assert [a["sha256"] for a in after["allocs"]] == [a["sha256"] for a in before["allocs"]]
    assert [a["uuid"] for a in after["allocs"]] == [B1, B0, B1]


def test_custom_storage_refusals(lib: Path, tmp_path: Path, spawn: Spawn) -> None:
    ec = libcuda.env(
        lib, write_node(tmp_path / "cs", [gpu(0)], custom_storage=True, driver_version=13040)
    )
    plain = libcuda.env(lib, write_node(tmp_path / "plain", [gpu(0)]))
    saved = str(tmp_path)
    p = spawn(tmp_path / "p", ec, [(0, MIB)])
    q = spawn(tmp_path / "q", plain, [(0, MIB)])
    res = control(
        ec,
        [
            ["init"],
            ["lock", p.pid, 0],
            ["cs_checkpoint", p.pid, saved],  # 2: no primary context retained here
            ["state", p.pid],
            ["retain", 0],
            ["pid"],  # 5
            ["cs_checkpoint", {"ref": 5}, saved],  # 6: this very process
        ],
    )
    assert err(res[2]) == "CUDA_ERROR_INVALID_CONTEXT"
    assert ok(res[3]) == "LOCKED"
    assert err(res[6]) == "CUDA_ERROR_NOT_SUPPORTED"
    # A driver without custom storage: that field is reserved there, and must be zero.
    res = control(
        plain, [["init"], ["retain", 0], ["lock", q.pid, 0], ["cs_checkpoint", q.pid, saved]]
    )
    assert err(res[3]) == "CUDA_ERROR_INVALID_VALUE"


def test_a_custom_storage_operation_whose_caller_dies_is_abandoned(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    e = libcuda.env(
        lib, write_node(tmp_path / "n", [gpu(0)], custom_storage=True, driver_version=13040)
    )
    p = spawn(tmp_path / "p", e, [(0, 2 * MIB)])
    saved = str(tmp_path)

    def state() -> str:
        return str(ok(control(e, [["state", p.pid]])[0]))

    res = control(
        e, [["init"], ["retain", 0], ["lock", p.pid, 0], ["cs_checkpoint", p.pid, saved, False]]
    )
    assert "ok" in res[3]  # the caller exits with the operation open
    wait_for(lambda: state() == "LOCKED", "the checkpoint to be abandoned")
    res = control(e, [["init"], ["retain", 0], ["cs_checkpoint", p.pid, saved]])
    assert state() == "CHECKPOINTED"
    res = control(e, [["init"], ["retain", 0], ["cs_restore", p.pid, None, saved, False]])
    assert "ok" in res[2]
    wait_for(lambda: state() == "CHECKPOINTED", "the restore to be abandoned")
    assert free_memory(e) == 141 * GIB
    res = control(
        e, [["init"], ["retain", 0], ["cs_restore", p.pid, None, saved], ["unlock", p.pid]]
    )
    assert all("ok" in r for r in res), res
    assert p.command("digest")["allocs"][0]["intact"]
