"""Engine identity probes against loopback HTTP servers speaking vLLM's and SGLang's API."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpusnap.daemon.gpu.engine_probe import probe_engine
from gpusnap.errors import FailedPrecondition, InvalidArgument, Unavailable

VLLM = {
    "/version": {"version": "0.11.0"},
    "/v1/models": {
        "object": "list",
        "data": [{"id": "qwen3-8b", "object": "model", "root": "/models/Qwen/Qwen3-8B"}],
    },
}
SGLANG = {
    "/get_model_info": {"model_path": "Qwen/Qwen3-8B", "is_generation": True},
    "/get_server_info": {"version": "0.5.3", "revision": "b8e9a1c"},
}


@pytest.fixture
def serve() -> Iterator[Callable[[dict[str, object]], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(routes: dict[str, object]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_vllm_reports_version_and_served_model(serve):
    url = serve(VLLM)
    found = probe_engine(url, "vllm")
    assert found["engine"] == {"name": "vllm", "version": "0.11.0", "source": f"probe:{url}"}
    assert found["model"]["name"] == "qwen3-8b"
    assert found["model"]["path"] == "/models/Qwen/Qwen3-8B"
    assert found["model"]["source"] == f"probe:{url}"


def test_sglang_reports_version_and_model_path(serve):
    url = serve(SGLANG)
    found = probe_engine(url, "sglang")
    assert found["engine"]["name"] == "sglang" and found["engine"]["version"] == "0.5.3"
    assert found["model"] == {
        "name": "Qwen/Qwen3-8B",
        "revision": "b8e9a1c",
        "source": f"probe:{url}",
    }


def test_auto_tells_sglang_from_vllm(serve):
    assert probe_engine(serve(SGLANG))["engine"]["name"] == "sglang"
    assert probe_engine(serve(VLLM))["engine"]["name"] == "vllm"


def test_garbage_answer_is_a_one_line_error(serve):
    url = serve({"/version": b"<html>oops</html>", "/v1/models": b"\x00\xff"})
    with pytest.raises(FailedPrecondition) as caught:
        probe_engine(url, "vllm")
    assert "not JSON" in str(caught.value) and "\n" not in str(caught.value)


def test_model_list_without_models_is_refused(serve):
    url = serve({"/version": {"version": "0.11.0"}, "/v1/models": {"data": []}})
    with pytest.raises(FailedPrecondition, match="lists no model"):
        probe_engine(url, "vllm")


def test_unreachable_server_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(Unavailable) as caught:
        probe_engine(f"http://127.0.0.1:{port}", "vllm", timeout_s=2)
    assert "\n" not in str(caught.value)


def test_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the connection in the kernel, never answers
    try:
        port = listener.getsockname()[1]
        with pytest.raises(Unavailable, match=r"(?i)timed out"):
            probe_engine(f"http://127.0.0.1:{port}", "vllm", timeout_s=0.3)
    finally:
        listener.close()


def test_non_http_url_is_invalid():
    with pytest.raises(InvalidArgument):
        probe_engine("file:///etc/passwd")
