"""The fake libcuda.so.1 through the real cuda-bindings: devices, contexts, memory, streams.

Every call runs in a process of its own (``ctl.py``) on a fake node; docs/gpu.md ("The fake
driver") lists the rules checked here and where each comes from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.fakes import libcuda
from tests.fakes.libcuda import Spawn, control, err, free_memory, ok
from tests.fakes.libcuda.nodes import B0, GIB, MIB, gpu, one_gpu_node, write_node

# -- devices ---------------------------------------------------------------------------------


def test_device_queries_answer_what_node_json_says(lib: Path, tmp_path: Path) -> None:
    gpus = [gpu(0), gpu(1, name="NVIDIA H100", total_memory=80 * GIB, compute_capability=(9, 1))]
    root = write_node(tmp_path / "n", gpus, driver_version=13040)
    res = control(libcuda.env(lib, root), [["init"], ["version"], ["devices"]])
    assert ok(res[1]) == 13040
    assert ok(res[2]) == [
        {
            "name": g["name"],
            "uuid": g["uuid"],
            "total_memory": g["total_memory"],
            "pci_bus_id": g["pci_bus_id"],
            "compute_capability": g["compute_capability"],
        }
        for g in gpus
    ]


def test_cuda_visible_devices_selects_and_orders_gpus_and_stops_at_an_unknown_entry(
    lib: Path, tmp_path: Path
) -> None:
    gpus = [gpu(0), gpu(1), gpu(2)]
    root = write_node(tmp_path / "n", gpus)
    for visible, want in [
        ("2,0", [2, 0]),
        (gpus[1]["uuid"][:12], [1]),  # a unique UUID prefix
        ("1,7,0", [1]),  # 7 names no GPU: the list ends there
    ]:
        res = control(libcuda.env(lib, root, CUDA_VISIBLE_DEVICES=visible), [["init"], ["devices"]])
        assert [d["uuid"] for d in ok(res[1])] == [gpus[i]["uuid"] for i in want], visible
    res = control(libcuda.env(lib, root, CUDA_VISIBLE_DEVICES=""), [["init"]])
    assert err(res[0]) == "CUDA_ERROR_NO_DEVICE"


def test_init_without_a_node_or_with_a_broken_node_json_finds_no_device(
    lib: Path, tmp_path: Path
) -> None:
    assert err(control(libcuda.env(lib, None), [["init"]])[0]) == "CUDA_ERROR_NO_DEVICE"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "node.json").write_text('{"driver_version": 13000, "gpus": [')
    assert err(control(libcuda.env(lib, broken), [["init"]])[0]) == "CUDA_ERROR_NO_DEVICE"


def test_get_proc_address_resolves_by_name_and_cuda_version(lib: Path, tmp_path: Path) -> None:
    plain = libcuda.env(lib, one_gpu_node(tmp_path))
    custom = libcuda.env(lib, write_node(tmp_path / "cs", [gpu(0)], custom_storage=True))
    ops = [
        ["proc_address", "cuCheckpointProcessLock", 12080],
        ["proc_address", "cuCheckpointProcessLock", 12000],
        ["proc_address", "cuNoSuchCall", 13000],
        ["proc_address", "cuCheckpointOperationComplete", 13040],
    ]
    lock, too_old, unknown, complete = (ok(r) for r in control(plain, ops))
    assert lock == {
        "result": "CUDA_SUCCESS",
        "found": True,
        "status": "CU_GET_PROC_ADDRESS_SUCCESS",
    }
    # cuda-bindings returns no status with an error: NOT_FOUND and no pointer is what shows.
    for missing in (too_old, unknown, complete):
        assert missing["result"] == "CUDA_ERROR_NOT_FOUND" and not missing["found"], missing
    assert ok(control(custom, ops[3:])[0])["found"]


# -- memory ----------------------------------------------------------------------------------


def test_memory_calls_without_a_current_context_fail_with_invalid_context(
    lib: Path, tmp_path: Path
) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    no_ctx: list[list[Any]] = [
        ["mem_alloc", 4096],
        ["host_register", 4096],
        ["stream_create", 0],
        ["current_mem_info"],
    ]
    res = control(e, [["init"], *no_ctx, ["retain", 0], *no_ctx, ["clear_current"], *no_ctx])
    assert [err(r) for r in res[1:5]] == ["CUDA_ERROR_INVALID_CONTEXT"] * 4
    assert all("ok" in r for r in res[5:10])
    assert [err(r) for r in res[11:]] == ["CUDA_ERROR_INVALID_CONTEXT"] * 4


def test_copies_and_memset_move_bytes_synchronously_and_on_streams(
    lib: Path, tmp_path: Path
) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    data = os.urandom(3 * MIB)
    n = len(data)
    a, b = {"ref": 2}, {"ref": 3}
    res = control(
        e,
        [
            ["init"],
            ["retain", 0],
            ["mem_alloc", n],  # 2
            ["mem_alloc", n],  # 3
            ["htod", a, data.hex()],
            ["dtod", b, a, n],
            ["memset", b, 0xAB, 4096],
            ["dtoh", b, n],  # 7
            ["stream_create", 1],  # 8: stream 1
            ["memset_async", a, 0x5A, 100, 1],
            ["dtoh_async", a, n, 1],  # 10
            ["stream_sync", 1],
            ["take", {"ref": 10}],  # 12
            ["dtoh", {"ref": 2, "add": n - 10}, 11],  # one byte past the allocation
            ["mem_alloc", 0],
            ["mem_free", a],
            ["mem_free", a],  # twice
        ],
    )
    assert all("ok" in r for r in res[:13]), res
    assert bytes.fromhex(ok(res[7])) == b"\xab" * 4096 + data[4096:]
    assert bytes.fromhex(ok(res[12])) == b"\x5a" * 100 + data[100:]
    assert [err(r) for r in res[13:15]] == ["CUDA_ERROR_INVALID_VALUE"] * 2
    assert "ok" in res[15] and err(res[16]) == "CUDA_ERROR_INVALID_VALUE"


def test_host_registration_refuses_overlaps_and_unknown_pointers(lib: Path, tmp_path: Path) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    res = control(
        e,
        [
            ["init"],
            ["retain", 0],
            ["host_register", 8192],  # 2
            ["host_register_at", {"ref": 2, "add": 4096}, 4096],  # inside the first
            ["host_unregister", {"ref": 2, "add": 4096}],  # not where a registration starts
            ["host_unregister", {"ref": 2}],
            ["host_unregister", {"ref": 2}],  # twice
            ["host_register_at", {"ref": 2, "add": 4096}, 4096],  # free again
        ],
    )
    assert err(res[3]) == "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
    assert err(res[4]) == "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"
    assert "ok" in res[5] and "ok" in res[7]
    assert err(res[6]) == "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"


def test_two_processes_on_one_node_share_free_memory_and_another_node_does_not(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    ea = libcuda.env(lib, one_gpu_node(tmp_path))
    eb = libcuda.env(lib, write_node(tmp_path / "node-b", [gpu(0, uuid=B0)]))
    total = 141 * GIB
    assert free_memory(ea) == free_memory(eb) == total
    p = spawn(tmp_path / "p", ea, [(0, 5 * MIB), (0, 3 * MIB)])
    assert free_memory(ea) == total - 8 * MIB
    assert free_memory(eb) == total
    assert p.command("mem_info", 0)["free"] == total - 8 * MIB
    p.kill()  # a process that dies frees its device memory, as on a GPU
    assert free_memory(ea) == total


def test_a_retained_context_holds_context_memory_until_released(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    root = write_node(tmp_path / "n", [gpu(0), gpu(1)], context_memory=256 * MIB)
    e = libcuda.env(lib, root)
    total = 141 * GIB
    res = control(e, [["init"], ["mem_info", 0], ["mem_info", 1], ["release", 1], ["mem_info", 0]])
    # Each caller's own context counts, on each GPU it retained one on.
    assert [ok(r)["free"] for r in (res[1], res[2], res[4])] == [total - 256 * MIB] * 3
    p = spawn(tmp_path / "p", e, [(0, MIB)])
    assert free_memory(e, 0) == total - 2 * 256 * MIB - MIB  # its context and ours
    assert free_memory(e, 1) == total - 256 * MIB  # only ours
    libcuda.checkpoint(e, p.pid)
    assert free_memory(e, 0) == total - 256 * MIB  # its context went with its memory
