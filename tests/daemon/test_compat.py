"""The compatibility policy: one table in code and in docs/compat.md, and what each rule says."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from gpusnap.daemon.config.file import EngineSpec, ModelSpec, WorkloadConfig
from gpusnap.daemon.gate.compat import POLICY, NodeFacts, check_compat
from gpusnap.daemon.gate.stamp import gpusnap_stamp, host_stamp

DOC = Path(__file__).resolve().parents[2] / "docs" / "compat.md"
ROW = re.compile(r"^\| `([^`]+)` \| (.+?) \| (.+) \|$")


def _stamp(**over: Any) -> dict[str, Any]:
    host = host_stamp(criu_version="4.1.1")
    stamp: dict[str, Any] = {
        "host": host,
        "gpusnap": gpusnap_stamp(),
        "engine": {"name": "vllm", "version": "0.11.0", "source": "config"},
        "model": {"name": "org/m", "revision": "abc", "source": "config"},
        "files": [],
    }
    stamp.update(over)
    return stamp


def _node(workload: WorkloadConfig | None = None, **host_over: Any) -> NodeFacts:
    host = {**host_stamp(criu_version="4.1.1"), **host_over}
    return NodeFacts(host=host, gpusnap=gpusnap_stamp(), workload=workload)


def _declared(rev: str = "abc", version: str = "0.11.0") -> WorkloadConfig:
    return WorkloadConfig(
        name="llm", engine=EngineSpec("vllm", version), model=ModelSpec("org/m", rev)
    )


def test_the_policy_table_in_the_docs_is_the_one_in_the_code() -> None:
    rows = [m.groups() for line in DOC.read_text().splitlines() if (m := ROW.match(line))]
    assert rows == [(r.field, r.rule, r.message) for r in POLICY]


def test_an_identical_node_is_compatible() -> None:
    assert check_compat(_stamp(), _node(_declared())) == []


def test_every_mismatch_is_reported_not_just_the_first() -> None:
    stamp = _stamp(host={**host_stamp(criu_version="3.17"), "arch": "aarch64"})
    reasons = check_compat(stamp, _node(_declared(rev="def", version="0.12.0")))
    fields = [r.field for r in reasons]
    assert fields == ["host.arch", "host.criu_version", "engine.version", "model.revision"]
    assert reasons[-1].message == "model revision differs: checkpoint abc, this node declares def"


def test_a_missing_cpu_feature_is_a_reason_but_an_extra_one_is_not() -> None:
    stamp = _stamp()
    stamp["host"] = {**stamp["host"], "cpu_features": ["avx512f", "sse2"]}
    reasons = check_compat(stamp, _node(None, cpu_features=["sse2", "avx2"]))
    assert [r.field for r in reasons] == ["host.cpu_features"]
    assert "avx512f" in reasons[0].message


def test_a_node_that_declares_no_engine_or_model_does_not_compare_them() -> None:
    assert check_compat(_stamp(), _node(None)) == []


def test_files_missing_or_changed_by_kind(tmp_path: Path) -> None:
    lib, out, gone = tmp_path / "lib.so", tmp_path / "out.txt", tmp_path / "gone"
    lib.write_bytes(b"x" * 10)
    out.write_bytes(b"y" * 10)
    st = lib.stat()
    files = [
        {"path": str(lib), "size": 10, "mtime_ns": st.st_mtime_ns, "kind": "mapped"},
        {"path": str(out), "size": 5, "mtime_ns": 0, "kind": "open-append"},
        {"path": str(gone), "size": 1, "mtime_ns": 0, "kind": "open-ro"},
    ]
    assert [r.message for r in check_compat(_stamp(files=files), _node(None))] == [
        f"file the process had open or mapped is missing here: {gone}"
    ]
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    reasons = check_compat(_stamp(files=files), _node(None))
    assert f"changed here: {lib} (mtime changed)" in reasons[0].message
