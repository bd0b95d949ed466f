"""Fuzzing every parser that sees bytes nobody has authenticated yet: envelopes (manifests, store
config), config payloads, manifests, chunk objects, gc records, CRIU images, and container
checkpoint archives (the tar stream a runtime exports, containerd's OCI layout, the parts record
a restore reads, and what a runtime prints of a container).

Seeded and bounded: each parser gets a fixed number of inputs mutated from real seeds (objects
a real store wrote, images built to CRIU's format), with mutations that aim at parsers (deep
nesting, lone surrogates, NaN, huge numbers, wrong types, cut and flipped bytes). Asserted:
only the project's error kinds come out (``GpusnapError``; ``ValueError`` for the CRIU image
reader, its documented error); no input hangs (the suite's timeout); memory stays flat -- the
peak per input is bounded by a multiple of the input's size. The figures (inputs, seconds,
peak memory) are printed (``pytest -s``).
"""

from __future__ import annotations

import functools
import io
import json
import os
import random
import shutil
import struct
import tarfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.containers.archive import pack, unpack_stream
from gpusnap.daemon.containers.containerd_format import parts_of_layout
from gpusnap.daemon.containers.criustats import parse_dump_stats
from gpusnap.daemon.containers.model import (
    PART_CONFIG,
    PART_CRIU,
    RECORD_FORMAT,
    RECORD_NAME,
    ContainerInfo,
    ContainerSpec,
    Device,
    Mount,
    Ulimit,
    load_parts,
)
from gpusnap.daemon.containers.oci import spec_from_oci
from gpusnap.daemon.containers.podman_format import spec_of
from gpusnap.daemon.host.criuimg import COMMON_MAGIC
from gpusnap.daemon.host.openfiles import recorded_sizes
from gpusnap.errors import Corrupt, GpusnapError, Internal
from gpusnap.storage import CheckpointStore
from gpusnap.storage.identity import CONFIG_FORMAT, StoreIdentity
from gpusnap.storage.layout import CONFIG_KEY, chunk_key, manifest_key
from gpusnap.storage.locks import GC_RECORD_FORMAT, gc_runs
from gpusnap.storage.manifest import ENVELOPE_FORMAT, Manifest
from gpusnap.storage.open import open_backend
from gpusnap.storage.untrusted import printable
from tests.storage.store_helpers import Keys, file_store, make_keys, write_src

SEED = 20261201
GC_BODY = {"started_at": 1.7e9, "finished_at": None, "swept": False, "refreshed_at": 1.7e9}
# Memory per input may reach this multiple of the input's size, plus a fixed allowance (a
# parsed JSON object is some tens of bytes per byte of text; a whole read is many times that).
MEMORY_FACTOR = 64
MEMORY_FLOOR = 4 * 1024 * 1024

DEEP = [b"[" * 3000, b"{" + b'"a":{' * 3000, b"[" * 200_000]
TOKENS = [
    b'"\\ud800"',
    b'"\\udfff\\u001b[2J"',
    b"NaN",
    b"-Infinity",
    b"1e999",
    b"9" * 5000,
    b"1" + b"0" * 30,
    b"null",
    b"[]",
    b"{}",
    b"\x00",
    b"\xff\xfe",
    b'"',
    b"\\",
    b"true",
]
JSON_VALUES: list[Any] = [
    None,
    True,
    -1,
    2**70,
    10**400,
    1e308,
    float("nan"),
    float("inf"),
    "\ud800",
    "\x1b]0;x\x07",
    "x" * 1000,
    [],
    {},
    [[[[[]]]]],
    {"a": {"b": {"c": []}}},
]


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randint(0, len(buf))
        if op == 0 and buf:  # flip bits
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert random bytes
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 2 and buf:  # delete a range
            del buf[pos : pos + rng.randint(1, 64)]
        elif op == 3:  # cut short
            del buf[pos:]
        elif op == 4:  # a token parsers trip on
            buf[pos:pos] = rng.choice(TOKENS)
        elif op == 5 and rng.random() < 0.1:  # deep nesting (rarely: it is the slow one)
            buf[pos:pos] = rng.choice(DEEP)
        elif op == 6 and buf:  # duplicate a range
            end = min(len(buf), pos + rng.randint(1, 256))
            buf[pos:pos] = buf[pos:end]
    return bytes(buf)


def _mutate_json(rng: random.Random, data: Any) -> Any:
    """``data`` with one value somewhere (or a key) replaced by something hostile."""
    if isinstance(data, dict) and data and rng.random() < 0.8:
        key = rng.choice(sorted(data))
        out = dict(data)
        if rng.random() < 0.1:
            out["\ud800" if rng.random() < 0.5 else key + "x"] = out.pop(key)
        else:
            out[key] = _mutate_json(rng, data[key])
        return out
    if isinstance(data, list) and data and rng.random() < 0.8:
        out_list = list(data)
        i = rng.randrange(len(out_list))
        out_list[i] = _mutate_json(rng, out_list[i])
        return out_list
    return rng.choice(JSON_VALUES)


def _mutants(rng: random.Random, seeds: list[bytes], count: int) -> Iterator[bytes]:
    for _ in range(count):
        seed = rng.choice(seeds)
        if rng.random() < 0.5:
            try:
                parsed = json.loads(seed)
            except ValueError:
                yield _mutate_bytes(rng, seed)
                continue
            text = json.dumps(_mutate_json(rng, parsed), ensure_ascii=rng.random() < 0.5)
            blob = text.encode("utf-8", "surrogatepass")
            yield _mutate_bytes(rng, blob) if rng.random() < 0.3 else blob
        else:
            yield _mutate_bytes(rng, seed)


@dataclass
class Figures:
    parser: str
    inputs: int = 0
    refused: int = 0
    seconds: float = 0.0
    peak: int = 0
    largest: int = 0

    def line(self) -> str:
        return (
            f"fuzz {self.parser}: {self.inputs} inputs ({self.refused} refused), "
            f"{self.seconds:.1f} s, peak memory {self.peak / 1024:.0f} KiB per input "
            f"(largest input {self.largest / 1024:.0f} KiB)"
        )


def _fuzz(
    name: str,
    parse: Callable[[bytes], object],
    seeds: list[bytes],
    count: int,
    allowed: tuple[type[BaseException], ...] = (GpusnapError,),
) -> Figures:
    rng = random.Random(f"{SEED}-{name}")
    figures = Figures(name)
    started = time.monotonic()
    tracemalloc.start()
    try:
        for blob in [*seeds, *_mutants(rng, seeds, count)]:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                parse(blob)
            except allowed:
                figures.refused += 1
            except BaseException as exc:
                pytest.fail(f"{name}: {type(exc).__name__}: {exc} on input {printable(blob)!r}")
            peak = tracemalloc.get_traced_memory()[1] - base
            assert peak <= MEMORY_FACTOR * len(blob) + MEMORY_FLOOR, (name, peak, len(blob))
            figures.inputs += 1
            figures.peak = max(figures.peak, peak)
            figures.largest = max(figures.largest, len(blob))
    finally:
        tracemalloc.stop()
    figures.seconds = time.monotonic() - started
    print(figures.line())
    return figures


def _fuzz_file(
    name: str, path: Path, read: Callable[[], object], seed: bytes, count: int
) -> Figures:
    """``_fuzz`` of a reader of the file at ``path`` (each input written there first); the
    seed is put back after."""

    def parse(blob: bytes) -> None:
        path.write_bytes(blob)
        read()

    try:
        return _fuzz(name, parse, [seed], count)
    finally:
        path.write_bytes(seed)


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CheckpointStore, str, Path]]:
    """A real store holding one small checkpoint: the seeds come from what it wrote."""
    tmp = tmp_path_factory.mktemp("fuzz")
    keys_dir = tmp / "keys"
    keys_dir.mkdir()
    keys: Keys = make_keys(keys_dir)
    store = file_store(tmp, keys)
    src = write_src(tmp / "src", {"a.img": b"pages" * 800, "b.img": bytes(3000), "c": b"x"})
    cid = store.push(src, workload="w").checkpoint_id
    try:
        yield store, cid, tmp / "store"
    finally:
        store.close()


def _seeds(real: tuple[CheckpointStore, str, Path]) -> dict[str, list[bytes]]:
    store, cid, root = real
    manifest = store.manifest(cid)
    envelope = (root / manifest_key("w", cid)).read_bytes()
    config = (root / CONFIG_KEY).read_bytes()
    chunks = [(root / chunk_key(c.id)).read_bytes() for f in manifest.files for c in f.chunks]
    return {
        "envelopes": [envelope, config],
        "manifest": [manifest.to_json()],
        "config": [store.context.identity.get().payload()],  # type: ignore[union-attr]
        "chunks": chunks,
        "gc-record": [
            json.dumps({"host": "h", "pid": 1, "started_at": 1.7e9, "finished_at": None}).encode(),
            json.dumps({"started_at": 1.7e9, "finished_at": 1.7e9 + 5, "swept": True}).encode(),
            store.context.keys.seal(GC_RECORD_FORMAT, json.dumps(GC_BODY).encode()),
        ],
    }


def test_fuzz_envelopes(real: tuple[CheckpointStore, str, Path]) -> None:
    keys = real[0].context.keys

    def parse(blob: bytes) -> None:
        # Unverified too: a store with ``verify = false`` parses what is inside.
        refused: GpusnapError | None = None
        for kind in (ENVELOPE_FORMAT, CONFIG_FORMAT):
            for verify in (True, False):
                try:
                    keys.unseal(blob, kind, what="fuzzed object", verify=verify)
                except GpusnapError as exc:
                    refused = exc
        if refused is not None:
            raise refused

    _fuzz("envelopes (manifest, store config)", parse, _seeds(real)["envelopes"], 1500)


def test_fuzz_manifests(real: tuple[CheckpointStore, str, Path]) -> None:
    _fuzz("manifest payloads", Manifest.from_json, _seeds(real)["manifest"], 1500)


def test_fuzz_store_config_payloads(real: tuple[CheckpointStore, str, Path]) -> None:
    _fuzz(
        "store config payloads",
        lambda blob: StoreIdentity.parse(blob, None),
        _seeds(real)["config"],
        3000,
    )


def test_fuzz_chunk_objects(real: tuple[CheckpointStore, str, Path]) -> None:
    store, cid, _root = real
    refs = [c for f in store.manifest(cid).files for c in f.chunks]
    codec = store.context.codec
    rng = random.Random(SEED)

    def parse(blob: bytes) -> None:
        ref = rng.choice(refs)  # the size the (authenticated) manifest declares
        codec.decode(ref.id, blob, ref.size)

    _fuzz("chunk objects (header, zstd, hash)", parse, _seeds(real)["chunks"], 3000)


def test_fuzz_gc_records(real: tuple[CheckpointStore, str, Path], tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path / 'store'}")
    ctx = replace(real[0].context, backend=backend)  # the real store's keys
    record = tmp_path / "store" / "locks" / "gc-fuzz"  # written as a store writer would
    record.parent.mkdir(parents=True)

    def parse(blob: bytes) -> None:
        record.write_bytes(blob)
        runs = gc_runs(ctx)  # an unauthentic record is judged by its age, never raises
        assert len(runs) == 1

    try:
        _fuzz("gc records (locks/gc-*)", parse, _seeds(real)["gc-record"], 600)
    finally:
        backend.close()


# --- CRIU images --------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _image(magic: int, entries: list[bytes]) -> bytes:
    body = b"".join(struct.pack("<I", len(e)) + e for e in entries)
    return struct.pack("<II", COMMON_MAGIC, magic) + body


def test_fuzz_criu_dump_stats() -> None:
    dump = b"".join(_field(k, 1000 * k) for k in range(1, 8))
    seed = _image(0x57093306, [_field(1, dump)])
    assert parse_dump_stats(seed)["pages_written"] == 7000
    _fuzz("CRIU stats-dump images", parse_dump_stats, [seed], 3000)


def test_fuzz_criu_files_and_mounts(tmp_path: Path) -> None:
    reg = _field(6, b"/app/data.bin") + _field(7, 2 * 5) + _field(8, 4096)  # mnt_id 5, zigzag
    files = _image(0x56303138, [_field(1, 1) + _field(3, reg)])
    mounts = _image(0x55563928, [_field(2, 5) + _field(7, b"/")])
    images = tmp_path / "images"
    images.mkdir()
    (images / "mountpoints-1.img").write_bytes(mounts)
    (images / "files.img").write_bytes(files)
    assert recorded_sizes(images) == {"app/data.bin": 4096}

    read = functools.partial(recorded_sizes, images)
    _fuzz_file("CRIU files.img", images / "files.img", read, files, 800)
    _fuzz_file("CRIU mountpoints images", images / "mountpoints-1.img", read, mounts, 800)


# --- container checkpoint archives ---------------------------------------------------------


def _unpack(blob: bytes, dest: Path) -> None:
    """``blob`` through a pipe into ``unpack_stream``, as a runtime's export arrives."""
    read_end, write_end = os.pipe()

    def write() -> None:
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(write_end, view[: 1 << 16]) :]
        except OSError:
            pass  # the reader stopped early (EPIPE): what it does then is under test
        finally:
            os.close(write_end)

    writer = threading.Thread(target=write)
    writer.start()
    dest.mkdir()
    try:
        unpack_stream(read_end, dest)
    finally:
        os.close(read_end)
        writer.join()
        shutil.rmtree(dest)


def _tar_seeds(tmp: Path) -> list[bytes]:
    src = tmp / "parts"
    long_dir = "checkpoint/" + "d" * 120  # a name past 100 bytes: a PAX or GNU long name
    (src / long_dir).mkdir(parents=True)
    files = {
        "config.dump": b'{"a": 1}',
        "checkpoint/pages-1.img": bytes(range(256)) * 9,
        f"{long_dir}/core.img": b"core" * 50,
        "deleted.files": b"",
    }
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    pack(src, sorted(files), tmp / "pax.tar")
    gnu = io.BytesIO()
    with tarfile.open(fileobj=gnu, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for rel in sorted(files):
            tar.add(src / rel, arcname=rel)
    return [(tmp / "pax.tar").read_bytes(), gnu.getvalue()]


def test_fuzz_container_tar_streams(tmp_path: Path) -> None:
    seeds = _tar_seeds(tmp_path)
    _unpack(seeds[0], tmp_path / "check")  # the seed itself unpacks
    runs = iter(range(10**9))
    _fuzz(
        "container archives (tar streams)",
        lambda blob: _unpack(blob, tmp_path / f"out{next(runs)}"),
        seeds,
        1500,
    )


def _container_record() -> dict[str, Any]:
    spec = ContainerSpec(
        image="localhost/tinylm:1",
        image_id="sha256:" + "a" * 64,
        command=("python", "serve.py"),
        env=("A=1",),
        mounts=(Mount("/data", "/srv/data", "bind", ("rbind",)),),
        devices=(Device("/dev/nvidia0", "/dev/nvidia0"),),
        ulimits=(Ulimit("nofile", 1024, 4096),),
        resources={"memory": "1073741824"},
        annotations={"k": "v"},
    )
    info = ContainerInfo("c1", "llm", "podman", "5.4.2", True, (10, 11), spec, {"pids": "max"})
    return {
        "format": RECORD_FORMAT,
        "container": info.as_dict(),
        "parts": {"config.dump": PART_CONFIG, "checkpoint/pages-1.img": PART_CRIU},
        "leave_running": False,
        "seconds": 1.5,
        "extra": {},
    }


def test_fuzz_container_checkpoint_records(tmp_path: Path) -> None:
    """The record (``gpusnap-container.json``) of a parts directory a restore pulled."""
    parts = tmp_path / "parts"
    (parts / "checkpoint").mkdir(parents=True)
    (parts / "config.dump").write_bytes(b"{}")
    (parts / "checkpoint" / "pages-1.img").write_bytes(b"pages")
    seed = json.dumps(_container_record()).encode()
    (parts / RECORD_NAME).write_bytes(seed)
    assert load_parts(parts).container.spec.ulimits == (Ulimit("nofile", 1024, 4096),)

    read = functools.partial(load_parts, parts)
    _fuzz_file("container checkpoint records", parts / RECORD_NAME, read, seed, 1500)


def test_fuzz_containerd_checkpoint_layouts(tmp_path: Path) -> None:
    """The OCI layout containerd exports a checkpoint image as: its index and manifests."""
    layout = tmp_path / "layout"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (blobs / ("c" * 64)).write_bytes(b"criu images")
    inner = {
        "manifests": [
            {
                "digest": "sha256:" + "c" * 64,
                "mediaType": "application/vnd.containerd.container.criu.checkpoint.criu.tar",
            }
        ]
    }
    (blobs / ("b" * 64)).write_text(json.dumps(inner))
    index = json.dumps({"manifests": [{"digest": "sha256:" + "b" * 64}]}).encode()
    (layout / "index.json").write_bytes(index)
    assert parts_of_layout(layout)[f"blobs/sha256/{'c' * 64}"] == PART_CRIU

    read = functools.partial(parts_of_layout, layout)
    _fuzz_file("containerd layouts (index.json)", layout / "index.json", read, index, 1000)
    manifest = json.dumps(inner).encode()
    _fuzz_file("containerd layouts (manifest)", blobs / ("b" * 64), read, manifest, 1000)


def test_fuzz_runtime_container_descriptions() -> None:
    """What a runtime prints of a container: podman's inspect JSON, an OCI ``config.json``."""
    podman = {
        "ImageName": "localhost/tinylm:1",
        "Config": {"Cmd": ["serve"], "Entrypoint": "/bin/sh", "Env": ["A=1"], "User": "1000"},
        "HostConfig": {
            "Ulimits": [{"Name": "RLIMIT_NOFILE", "Soft": 1024, "Hard": 4096}],
            "Devices": [{"PathOnHost": "/dev/nvidia0", "PathInContainer": "/dev/nvidia0"}],
            "Memory": 1 << 30,
        },
        "Mounts": [{"Destination": "/data", "Source": "/srv", "Type": "bind", "RW": False}],
    }
    oci = {
        "process": {
            "args": ["serve"],
            "env": ["A=1"],
            "user": {"uid": 1000, "gid": 1000},
            "rlimits": [{"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 4096}],
        },
        "mounts": [{"destination": "/data", "source": "/srv", "options": ["rbind"]}],
        "linux": {
            "resources": {"memory": {"limit": 1 << 30}, "cpu": {"quota": 5000}},
            "namespaces": [{"type": "network"}],
            "devices": [{"path": "/dev/nvidia0"}],
        },
        "annotations": {"org.opencontainers.image.ref.name": "tinylm"},
    }
    assert spec_of(podman, "sha256:x").ulimits == (Ulimit("nofile", 1024, 4096),)
    assert spec_from_oci(oci, image_id="sha256:x").user == "1000:1000"

    def parse_json(blob: bytes) -> Any:
        try:  # as ``Runtime.json`` reads what the runtime printed
            return json.loads(blob)
        except (ValueError, RecursionError) as exc:
            raise Internal("printed no JSON") from exc

    _fuzz(
        "podman inspect JSON",
        lambda blob: spec_of(parse_json(blob), "sha256:x"),
        [json.dumps(podman).encode()],
        1500,
    )
    _fuzz(
        "OCI config.json",
        lambda blob: spec_from_oci(parse_json(blob), image_id="sha256:x"),
        [json.dumps(oci).encode()],
        1500,
    )


def test_a_tar_header_claiming_a_huge_extended_header_is_refused_unread(tmp_path: Path) -> None:
    """A PAX header that claims 4 GiB is refused before anything is read for it (a reader that
    asked the pipe for the claimed size at once would allocate it)."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 4 << 30
    blob = info.tobuf(format=tarfile.USTAR_FORMAT) + b"30 path=" + b"a" * 21 + b"\n"
    tracemalloc.start()
    try:
        with pytest.raises(Corrupt, match="an extended header of 4294967296 bytes"):
            _unpack(blob, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_FLOOR, peak


def test_a_containerd_layout_digest_never_names_a_file_outside_it(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (tmp_path / "secret").write_text('{"manifests": []}')  # would parse, were it read
    escape = {"manifests": [{"digest": "sha256:../../../secret"}]}
    (layout / "index.json").write_text(json.dumps(escape))
    with pytest.raises(Corrupt, match="names a digest that is not one"):
        parts_of_layout(layout)
