"""The stamp a checkpoint carries: what it was taken against.

A stamp records the host (kernel, arch, CPU, CRIU), the gpusnap and store-format versions, the
workload's engine and model (declared in config or probed from the process), the files the
process had open or mapped, the launch spec for a cold start, the process tree, and (from the
GPU layer) the GPUs and driver. Each engine/model field records its ``source``: ``config``,
``probed`` or ``none``; the model section's directory and the digest of its files come from
``daemon/gate/model_digest.py``. ``checkpoint_stamp`` is its schema; the gate that judges it on
restore is ``daemon/gate/compat.py``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gpusnap
from gpusnap.daemon.config.file import WorkloadConfig
from gpusnap.daemon.host.proctree import ProcessInfo
from gpusnap.storage.manifest import SCHEMA_VERSION

STAMP_VERSION = 1
# The Python packages whose versions identify a serving engine, in order of precedence.
ENGINE_PACKAGES = ("vllm", "sglang", "transformers", "torch")
# CPU flags that change which instructions user space may run (and which xsave state CRIU
# restores). A process that ran with one of these may crash where it is missing, so every one
# the checkpoint's node had must be present here. Other flags (e.g. virtualisation hints) differ
# harmlessly between hosts of one fleet.
_CPU_FEATURE = re.compile(
    r"^(fpu|mmx|sse\w*|ssse3|pni|avx\w*|xsave\w*|fma|fma4|f16c|amx\w*|pku|ospke|bmi1|bmi2|adx|"
    r"sha_ni|aes|vaes|pclmulqdq|vpclmulqdq|gfni|popcnt|movbe|abm|lzcnt|rdrand|rdseed|"
    # aarch64 "Features" names
    r"fp|asimd\w*|sve\w*|sme\w*|atomics|crc32|sha\d|pmull|lrcpc|dcpop|bf16|i8mm)$"
)


# --- this node --------------------------------------------------------------------------------


def cpu_info() -> tuple[str, list[str]]:
    """(model name, sorted flags) from /proc/cpuinfo; ("unknown", []) where it cannot be read."""
    model = "unknown"
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return model, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model == "unknown":
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, sorted(flags)


def host_stamp(*, criu_version: str, node_id: str | None = None) -> dict[str, Any]:
    """The ``host`` section for this node."""
    model, flags = cpu_info()
    return {
        "node_id": node_id or socket.gethostname(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "cpu_model": model,
        "cpu_flags_digest": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16],
        "cpu_features": [f for f in flags if _CPU_FEATURE.match(f)],
        "criu_version": criu_version,
    }


def gpusnap_stamp() -> dict[str, Any]:
    return {"version": gpusnap.__version__, "store_format": SCHEMA_VERSION}


def identity_stamp(
    workload: WorkloadConfig | None, probed_packages: Mapping[str, str] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``engine`` and ``model`` sections: declared in config, or probed, or none."""
    engine: dict[str, Any] = {"source": "none"}
    if workload is not None and workload.engine is not None:
        engine = _declared(workload.engine.name, version=workload.engine.version)
    elif probed_packages:
        for name in ENGINE_PACKAGES:
            if name in probed_packages:
                engine = {"name": name, "version": probed_packages[name], "source": "probed"}
                break
        engine["packages"] = {k: probed_packages[k] for k in sorted(probed_packages)}
        engine.setdefault("source", "probed")
    model: dict[str, Any] = {"source": "none"}
    if workload is not None and workload.model is not None:
        model = _declared(workload.model.name, revision=workload.model.revision)
    return engine, model


def _declared(name: str, **fields: str) -> dict[str, Any]:
    return {"name": name, **fields, "source": "config"}


def file_entry(path: str, kind: str) -> dict[str, Any] | None:
    """(path, size, mtime) of a regular file the process has open or mapped, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "kind": kind}


def checkpoint_stamp(
    *,
    host: Mapping[str, Any],
    engine: Mapping[str, Any],
    model: Mapping[str, Any],
    files: Sequence[Mapping[str, Any]],
    launch: Mapping[str, Any],
    gpu: Mapping[str, Any],
    tree: Sequence[ProcessInfo],
    uids: Sequence[int] = (),
) -> dict[str, Any]:
    """The whole stamp of a checkpoint of ``tree`` (root first); the store signs it with the
    manifest. ``files`` are ``file_entry`` records, ``gpu`` the GPU layer's section, ``uids``
    every uid the tree's processes had (whose a restore would bring back)."""
    root = tree[0]
    return {
        "stamp_version": STAMP_VERSION,
        "host": dict(host),
        "gpusnap": gpusnap_stamp(),
        "engine": dict(engine),
        "model": dict(model),
        "files": [dict(f) for f in files],
        "launch": dict(launch),
        "gpu": dict(gpu),
        "process": {
            "root_pid": root.pid,
            "pids": [p.pid for p in tree],
            "threads": sum(p.threads for p in tree),
            "comm": Path(root.exe).name if root.exe else "",
            "uids": list(uids),
        },
    }
