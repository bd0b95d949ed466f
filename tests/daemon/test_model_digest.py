"""The model directory's digest, its per-file cache, the command-line probe and the gate's rule."""

from __future__ import annotations

import os
from pathlib import Path

from blake3 import blake3

from gpusnap.daemon.config.file import WorkloadConfig
from gpusnap.daemon.gate.compat import NodeFacts, check_compat
from gpusnap.daemon.gate.model_digest import (
    CACHE_NAME,
    DigestCache,
    model_dir_of,
    model_dir_stamp,
    model_files,
)
from gpusnap.daemon.gate.stamp import gpusnap_stamp, host_stamp


def _model(root: Path) -> Path:
    d = root / "model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"layers": 2}')
    (d / "tokenizer.json").write_text('{"vocab": {}}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "sub" / "extra.bin").write_bytes(b"\x01" * 100)
    (d / "README.md").write_text("not part of the model")
    (d / ".cache").mkdir()
    (d / ".cache" / "stale.json").write_text("{}")
    return d


def test_the_digest_is_blake3_over_name_size_and_content_in_name_order(tmp_path: Path) -> None:
    d = _model(tmp_path)
    names = [p.relative_to(d).as_posix() for p in model_files(d)]
    assert names == ["config.json", "model.safetensors", "sub/extra.bin", "tokenizer.json"]
    h = blake3()
    for name in names:
        data = (d / name).read_bytes()
        h.update(f"{name}\0{len(data)}\0{blake3(data).hexdigest()}\n".encode())
    got = DigestCache(None).directory_digest(d)
    assert got.digest == h.hexdigest()
    assert got.files == 4
    assert got.bytes == sum((d / n).stat().st_size for n in names)


def test_one_changed_byte_or_name_changes_the_digest(tmp_path: Path) -> None:
    d = _model(tmp_path)
    before = DigestCache(None).directory_digest(d).digest
    (d / "README.md").write_text("edited")  # not a model file
    assert DigestCache(None).directory_digest(d).digest == before
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[100] ^= 1
    w.write_bytes(bytes(data))
    changed = DigestCache(None).directory_digest(d).digest
    assert changed != before
    (d / "sub" / "extra.bin").rename(d / "sub" / "other.bin")
    assert DigestCache(None).directory_digest(d).digest != changed


def test_the_cache_rehashes_a_changed_file_only_and_survives_a_restart(tmp_path: Path) -> None:
    d = _model(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    cache = DigestCache(state / CACHE_NAME)
    first = cache.directory_digest(d)
    assert cache.reads == 4
    assert cache.directory_digest(d) == first
    assert cache.reads == 4  # nothing changed: nothing read

    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[0] ^= 1
    st = w.stat()
    w.write_bytes(bytes(data))
    os.utime(
        w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000)
    )  # a later mtime, whatever the clock
    second = cache.directory_digest(d)
    assert cache.reads == 5  # the weights file alone
    assert second.digest != first.digest

    again = DigestCache(state / CACHE_NAME)  # the daemon restarted: the file on disk is used
    assert again.directory_digest(d) == second
    assert again.reads == 0


def test_the_model_directory_is_found_on_an_engines_command_line(tmp_path: Path) -> None:
    d = _model(tmp_path)
    assert model_dir_of(["vllm", "serve", str(d), "--port", "8000"], None) == d
    assert model_dir_of(["python", "-m", "x", "--model", "model"], str(tmp_path)) == d
    assert model_dir_of(["python", "-m", "x", f"--model-path={d}"], None) == d
    assert model_dir_of(["launcher", "--model-id", str(d)], None) == d
    assert model_dir_of(["vllm", "serve", "org/not-a-dir"], str(tmp_path)) is None
    assert model_dir_of(["python", "train.py"], None) is None


def test_the_stamp_section_records_the_directory_and_its_source(tmp_path: Path) -> None:
    d = _model(tmp_path)
    cache = DigestCache(None)
    declared = model_dir_stamp(d, {"command": ["x"]}, cache)
    assert declared["dir"] == str(d) and declared["dir_source"] == "config"
    assert declared["digest"] == cache.directory_digest(d).digest
    probed = model_dir_stamp(None, {"command": ["vllm", "serve", str(d)], "cwd": "/"}, cache)
    assert probed["dir_source"] == "probed" and probed["digest"] == declared["digest"]
    assert model_dir_stamp(None, {"command": ["python", "x.py"], "cwd": "/"}, cache) == {}
    missing = model_dir_stamp(tmp_path / "gone", {}, cache)
    assert missing == {"dir": str(tmp_path / "gone"), "dir_source": "config"}


def _stamp(model: dict[str, object]) -> dict[str, object]:
    return {
        "host": host_stamp(criu_version="4.2.1"),
        "gpusnap": gpusnap_stamp(),
        "engine": {"source": "none"},
        "model": model,
        "files": [],
    }


def _facts(workload: WorkloadConfig | None = None) -> NodeFacts:
    return NodeFacts(
        host=host_stamp(criu_version="4.2.1"), gpusnap=gpusnap_stamp(), workload=workload
    )


def test_the_gate_compares_the_digest_here(tmp_path: Path) -> None:
    d = _model(tmp_path)
    digest = DigestCache(None).directory_digest(d).digest
    stamp = _stamp({"source": "none", "dir": str(d), "digest": digest})
    assert check_compat(stamp, _facts()) == []

    (d / "config.json").write_text('{"layers": 3}')
    (reason,) = check_compat(stamp, _facts())
    now = DigestCache(None).directory_digest(d).digest
    assert reason.field == "model.digest"
    assert (reason.expected, reason.actual) == (digest[:12], now[:12])
    assert reason.message == (
        f"model files differ in {d}: checkpoint digest {digest[:12]}, here {now[:12]}"
    )

    # This node's model_dir for the workload is the one digested, not the recorded one.
    other = tmp_path / "elsewhere"
    _model(other)
    w = WorkloadConfig(name="llm", model_dir=other / "model")
    assert check_compat(stamp, _facts(w)) == []

    moved = _stamp({"source": "none", "dir": "/nonexistent", "digest": digest})
    (missing,) = check_compat(moved, _facts())
    assert missing.field == "model.digest" and missing.actual == "missing"
    assert missing.message.startswith("model directory cannot be read here: /nonexistent (")


def test_a_stamp_without_a_digest_is_not_judged_by_it(tmp_path: Path) -> None:
    w = WorkloadConfig(name="llm", model_dir=tmp_path / "nothing-here")
    assert check_compat(_stamp({"source": "none"}), _facts(w)) == []
    assert check_compat(_stamp({"source": "none", "dir": "/nonexistent"}), _facts()) == []
