"""vLLM's OpenAI server (the CPU build) for the tests: installed, model made, started under
``gpusnap exec``, asked for greedy completions (whole or streamed) over real HTTP.

The install is ``scripts/install-vllm.sh`` (a venv of its own, cached); nothing here installs
anything. The model is made offline by ``make_model.py`` and cached by that file's content.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.host import tmpfsfiles

HERE = Path(__file__).parent
VENV = Path(os.environ.get("GPUSNAP_VLLM_VENV", "/opt/gpusnap/vllm-venv"))
VERSION = "0.32.0"
STAMP = VENV / f".gpusnap-vllm-{VERSION}"
MODELS = VENV.parent / "vllm-models"
START_GUARD = 900.0  # seconds; against hangs only (a cold start on 2 busy cores is slow)
GPUSNAP = [sys.executable, "-m", "gpusnap.cli.main"]

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self",
    "The quick brown fox",
]
MAX_TOKENS = 48


def python() -> Path:
    """The vLLM venv's interpreter; the test fails (not skips) when it is not installed."""
    if not STAMP.is_file():
        pytest.fail(
            f"vLLM {VERSION} is not installed in {VENV}: run scripts/install-vllm.sh "
            "(scripts/bootstrap.sh does)"
        )
    return VENV / "bin" / "python"


def model_dir() -> Path:
    """The tiny model, made once per content of make_model.py (the same bytes every run)."""
    maker = HERE / "make_model.py"
    digest = hashlib.sha256(maker.read_bytes()).hexdigest()[:16]
    out = MODELS / digest
    if (out / "model.safetensors").is_file():
        return out
    MODELS.mkdir(parents=True, exist_ok=True)
    tmp = MODELS / f".{digest}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([str(python()), str(maker), str(tmp)], check=True, timeout=600)
    with contextlib.suppress(OSError):  # another run made it meanwhile: keep theirs
        tmp.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve_command(model: Path, port: int) -> list[str]:
    """``vllm serve`` through the launcher, under ``gpusnap exec``."""
    return [
        *GPUSNAP,
        "exec",
        "--",
        str(python()),
        str(HERE / "launcher.py"),
        "serve",
        str(model),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def serve_env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        "VLLM_CACHE_ROOT": str(cache),
    }


@dataclass
class Server:
    """One server process tree (its root, the API server, is ours or a restored one)."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    pid: int = 0

    @classmethod
    def start(cls, model: Path, workdir: Path) -> Server:
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        # Appended: CRIU does not hold an O_APPEND log to its size at restore.
        with open(workdir / "server.out", "ab") as out:
            proc = subprocess.Popen(
                serve_command(model, port),
                cwd=workdir,
                env=serve_env(workdir / "cache"),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        server = cls(port, workdir, proc, proc.pid)
        server.wait_healthy()
        return server

    def log(self) -> str:
        try:
            return (self.workdir / "server.out").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            return request(self.port, "GET", "/health", timeout=10)[0] == 200
        except OSError:
            return False

    def wait_healthy(self, guard: float = START_GUARD) -> float:
        """Seconds until /health answers 200 (the process dying fails at once)."""
        t0 = time.monotonic()
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}): {self.log()}")
            if time.monotonic() - t0 > guard:
                raise TimeoutError(f"vLLM not healthy after {guard:.0f}s: {self.log()}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def complete(self, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
        return complete(self.port, prompt, max_tokens)

    def kill(self) -> None:
        """SIGKILL the tree (its session), reap what is ours, and remove the /dev/shm files
        it held (a killed vLLM leaves them behind)."""
        pids = tree(self.pid) if self.pid else []
        shm: set[str] = set()
        with contextlib.suppress(OSError):
            shm = {n for h in tmpfsfiles.held_files(self.pid) for n in h.names}
        with contextlib.suppress(OSError):
            os.killpg(self.pid, 9)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        reap(pids)
        if self.proc is not None:
            self.proc.wait(60)
        for name in shm:
            Path(name).unlink(missing_ok=True)


def tree(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    todo += [
                        int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                    ]
    return out


def reap(pids: list[int], guard: float = 120.0) -> None:
    """Wait until ``pids`` are gone: reaped where they are our (adopted) children, so that a
    restore can have them again."""
    end = time.monotonic() + guard
    for pid in pids:
        while Path(f"/proc/{pid}").exists():
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            if time.monotonic() > end:
                raise TimeoutError(f"pid {pid} still there")
            time.sleep(0.05)


def request(
    port: int, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 300
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def greedy(prompt: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "",  # filled by the caller: the served model's name is its path
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def complete(port: int, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
    """A greedy completion: its text and token ids."""
    body = greedy(prompt, max_tokens)
    body["model"] = served_model(port)
    status, data = request(port, "POST", "/v1/completions", body)
    assert status == 200, data[:500]
    choice = json.loads(data)["choices"][0]
    return choice["text"], list(choice.get("token_ids") or [])


_MODEL_NAMES: dict[int, str] = {}


def served_model(port: int) -> str:
    if port not in _MODEL_NAMES:
        status, data = request(port, "GET", "/v1/models")
        assert status == 200, data[:500]
        _MODEL_NAMES[port] = json.loads(data)["data"][0]["id"]
    return _MODEL_NAMES[port]


@dataclass
class Stream:
    """A streamed greedy completion read on a thread: ``first`` is set at its first token."""

    port: int
    prompt: str
    max_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    done: bool = False  # the server sent [DONE]
    error: str | None = None
    first: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self.run, daemon=True).start()
        return self

    def run(self) -> None:
        try:
            body = greedy(self.prompt, self.max_tokens, stream=True)
            body["model"] = served_model(self.port)
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            conn.request(
                "POST",
                "/v1/completions",
                body=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    self.done = True
                    break
                choice = json.loads(payload)["choices"][0]
                self.text += choice.get("text", "")
                self.token_ids += list(choice.get("token_ids") or [])
                self.first.set()
            conn.close()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.first.set()
            self.ended.set()


class Streams:
    """``width`` streamed completions always in flight: each thread starts the next as soon as
    its last one ends, until ``stop`` or until the server stops answering (one ended with an
    error). Whenever the server is stopped, some are cut mid-generation."""

    def __init__(self, port: int, prompts: list[str], max_tokens: int) -> None:
        self.port, self.prompts, self.max_tokens = port, prompts, max_tokens
        self.all: list[Stream] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(p,), daemon=True) for p in prompts
        ]
        for t in self._threads:
            t.start()

    def _loop(self, prompt: str) -> None:
        while not self._stop.is_set():
            s = Stream(self.port, prompt, self.max_tokens)
            self.all.append(s)
            s.run()
            if s.error is not None:
                return

    def wait_generating(self, guard: float = 300.0) -> None:
        """Until every prompt's stream has had a token."""
        end = time.monotonic() + guard
        while {s.prompt for s in self.all if s.token_ids} != set(self.prompts):
            assert time.monotonic() < end, "the streams never started"
            time.sleep(0.05)

    def stop(self, guard: float = 300.0) -> list[Stream]:
        self._stop.set()
        for t in self._threads:
            t.join(guard)
            assert not t.is_alive(), "a stream did not end"
        return list(self.all)
