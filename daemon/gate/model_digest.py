"""The model directory a workload serves, and a digest of its config and weights files.

The stamp's ``model`` section records ``dir`` (declared as ``[[workload]] model_dir``, or found
on the root process's command line: ``--model DIR``, ``--model-path DIR``, ``--model-id DIR`` or
``serve DIR``, when DIR is a directory) and ``digest``: BLAKE3 over each config, tokenizer and
weights file's (relative name, size, content) in sorted name order. The gate computes the same
digest here (``daemon/gate/compat.py``): other weights restore as a cold start.

Hashing 100 GB takes minutes, so each file's content hash is cached in the state dir by
(device, inode, size, mtime_ns, ctime_ns): a node reads a model's files once, not every checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blake3 import blake3

log = logging.getLogger(__name__)

# Config and tokenizer files, and weights files: what decides what the model computes.
CONFIG_SUFFIXES = (".json", ".model", ".tiktoken", ".txt", ".jinja")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The command-line flags engines take the model directory with (vLLM, SGLang, TGI).
_MODEL_FLAGS = ("--model", "--model-path", "--model-id")
_READ = 1 << 20
CACHE_NAME = "model-digests.json"


@dataclass(frozen=True)
class ModelDigest:
    digest: str  # hex BLAKE3
    files: int
    bytes: int


def model_files(directory: Path) -> list[Path]:
    """The config and weights files under ``directory`` (hidden folders skipped), sorted by
    their relative name. A file's suffix decides: ``CONFIG_SUFFIXES`` (configs, tokenizers,
    chat templates) and ``WEIGHT_SUFFIXES``."""
    found: list[Path] = []
    # Links to folders are not followed (a cycle would never end); links to files are.
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.endswith(CONFIG_SUFFIXES + WEIGHT_SUFFIXES) and not name.startswith("."):
                path = Path(root) / name
                if path.is_file():  # a link to a file counts (the Hugging Face cache's layout)
                    found.append(path)
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


class DigestCache:
    """Each file's content BLAKE3, by (device, inode, size, mtime_ns, ctime_ns), kept in one
    JSON file. The ctime too: an edit in place whose mtime was put back (``touch -r``, ``rsync
    -t``) still changes it.

    ``None`` for ``path``: in memory only. ``reads`` counts the files hashed (not found here).
    """

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, int | str]] = {}
        self.reads = 0
        if path is not None:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(data, dict):
                    self._entries = {k: v for k, v in data.items() if isinstance(v, dict)}
            except (OSError, ValueError):
                pass  # none yet, or unreadable: every file is hashed again

    def file_digest(self, path: Path) -> tuple[str, int]:
        """(content BLAKE3, size) of ``path``: from the cache when its identity is unchanged."""
        st = path.stat()
        key = f"{st.st_dev}:{st.st_ino}"
        with self._lock:
            hit = self._entries.get(key)
        if (
            hit is not None
            and hit.get("size") == st.st_size
            and hit.get("mtime_ns") == st.st_mtime_ns
        ):
            return str(hit["blake3"]), st.st_size
        h = blake3()
        with path.open("rb") as f:
            while block := f.read(_READ):
                h.update(block)
        digest = h.hexdigest()
        with self._lock:
            self.reads += 1
            self._entries[key] = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "ctime_ns": st.st_ctime_ns,
                "blake3": digest,
            }
        return digest, st.st_size

    def save(self) -> None:
        if self._path is None:
            return
        with self._lock:
            text = json.dumps(self._entries, sort_keys=True)
        tmp = self._path.with_name(f"{self._path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self._path)
        except OSError as exc:  # the digest stands; only the next one is slower
            log.warning("cannot save the model digest cache %s: %s", self._path, exc)
            tmp.unlink(missing_ok=True)

    def directory_digest(self, directory: Path) -> ModelDigest:
        """BLAKE3 over (relative name, size, content hash) of each of ``model_files``, in order.
        Raises OSError when the directory or a file cannot be read."""
        if not directory.is_dir():
            raise FileNotFoundError(f"not a directory: {directory}")
        h = blake3()
        total = 0
        files = model_files(directory)
        for path in files:
            digest, size = self.file_digest(path)
            name = path.relative_to(directory).as_posix()
            h.update(f"{name}\0{size}\0{digest}\n".encode())
            total += size
        self.save()
        return ModelDigest(digest=h.hexdigest(), files=len(files), bytes=total)


_caches: dict[Path, DigestCache] = {}
_caches_lock = threading.Lock()


def cache_in(state_dir: Path) -> DigestCache:
    """The one cache of the state dir ``state_dir`` in this process."""
    path = state_dir / CACHE_NAME
    with _caches_lock:
        if path not in _caches:
            _caches[path] = DigestCache(path)
        return _caches[path]


def model_dir_of(command: Sequence[str], cwd: str | None) -> Path | None:
    """The model directory on an engine's command line (``--model DIR``, ``--model=DIR``,
    ``--model-path``, ``--model-id``, ``serve DIR``), when it names a directory; else None."""
    found: str | None = None
    for i, arg in enumerate(command):
        flag, eq, value = arg.partition("=")
        if flag in _MODEL_FLAGS:
            found = value if eq else (command[i + 1] if i + 1 < len(command) else None)
        elif arg == "serve" and i + 1 < len(command) and not command[i + 1].startswith("-"):
            found = command[i + 1]
        if found is not None:
            break
    if not found:
        return None
    path = Path(cwd or "/") / found
    return path if path.is_dir() else None


def short(digest: object) -> str:
    """The first 12 hex digits, as reasons show a digest."""
    return str(digest)[:12] if digest else "(none)"


def model_dir_stamp(
    declared: Path | None, launch: Mapping[str, Any], cache: DigestCache
) -> dict[str, Any]:
    """The ``dir``, ``dir_source`` and ``digest`` (with ``files`` and ``bytes``) keys of the
    stamp's model section; none when no directory is declared or found. A declared directory
    that cannot be read is recorded without a digest (the checkpoint goes on)."""
    directory = declared
    source = "config"
    if directory is None:
        command = launch.get("command")
        cwd = launch.get("cwd")
        if isinstance(command, list):
            directory = model_dir_of(
                [str(a) for a in command], cwd if isinstance(cwd, str) else None
            )
        source = "probed"
    if directory is None:
        return {}
    out: dict[str, Any] = {"dir": str(directory), "dir_source": source}
    started = time.monotonic()
    try:
        d = cache.directory_digest(directory)
    except OSError as exc:
        log.warning("cannot digest the model directory %s: %s", directory, exc)
        return out
    log.info(
        "model directory %s: %d files, %d bytes, digest %s in %.3fs",
        directory,
        d.files,
        d.bytes,
        short(d.digest),
        time.monotonic() - started,
    )
    return {**out, "digest": d.digest, "files": d.files, "bytes": d.bytes}
