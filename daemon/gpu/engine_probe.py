"""Ask a running vLLM or SGLang server what it is: engine version and served model.

Used for the stamp when the workload is configured with its server URL. Every field records
where it came from (``probe:<url>``). Unreachable servers, timeouts and answers that are not
what the engine documents raise one-line errors; nothing here retries.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

from gpusnap.errors import FailedPrecondition, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang")
MAX_BODY = 1024 * 1024


def _get_json(base: str, path: str, timeout_s: float) -> Any:
    url = base.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - http(s) only
            body = resp.read(MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        raise Unavailable(f"engine probe GET {url}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unavailable(f"engine probe GET {url}: {type(exc).__name__}: {reason}") from exc
    if len(body) > MAX_BODY:
        raise FailedPrecondition(f"engine probe GET {url}: answer larger than {MAX_BODY} bytes")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise FailedPrecondition(f"engine probe GET {url}: answer is not JSON") from exc


def _text(value: Any, what: str, url: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise FailedPrecondition(f"engine probe {url}: no {what} in the answer")
    return value.strip()


def _probe_vllm(url: str, timeout_s: float) -> dict[str, Any]:
    source = f"probe:{url}"
    version = _get_json(url, "/version", timeout_s)
    models = _get_json(url, "/v1/models", timeout_s)
    if not isinstance(version, dict) or not isinstance(models, dict):
        raise FailedPrecondition(f"engine probe {url}: answers are not JSON objects like vLLM's")
    data = models.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise FailedPrecondition(f"engine probe {url}: /v1/models lists no model")
    first = data[0]
    model: dict[str, Any] = {"name": _text(first.get("id"), "model id", url), "source": source}
    root = first.get("root")
    if isinstance(root, str) and root and root != model["name"]:
        model["path"] = root
    return {
        "engine": {
            "name": "vllm",
            "version": _text(version.get("version"), "version", url),
            "source": source,
        },
        "model": model,
    }


def _probe_sglang(url: str, timeout_s: float) -> dict[str, Any]:
    source = f"probe:{url}"
    info = _get_json(url, "/get_model_info", timeout_s)
    server = _get_json(url, "/get_server_info", timeout_s)
    if not isinstance(info, dict) or not isinstance(server, dict):
        raise FailedPrecondition(f"engine probe {url}: answers are not JSON objects like SGLang's")
    model: dict[str, Any] = {"name": _text(info.get("model_path"), "model_path", url)}
    revision = server.get("revision")
    if isinstance(revision, str) and revision:
        model["revision"] = revision
    model["source"] = source
    return {
        "engine": {
            "name": "sglang",
            "version": _text(server.get("version"), "version", url),
            "source": source,
        },
        "model": model,
    }


def probe_engine(url: str, engine: str = "auto", *, timeout_s: float = 5.0) -> dict[str, Any]:
    """``{"engine": {name, version, source}, "model": {name, revision?, source}}``.

    ``engine`` is "vllm", "sglang" or "auto" (vLLM's endpoints first, then SGLang's).
    """
    if not url.startswith(("http://", "https://")):
        raise InvalidArgument(f"engine URL {url!r} must start with http:// or https://")
    if engine == "vllm":
        return _probe_vllm(url, timeout_s)
    if engine == "sglang":
        return _probe_sglang(url, timeout_s)
    if engine != "auto":
        raise InvalidArgument(f"unknown engine {engine!r}: use vllm, sglang or auto")
    try:
        return _probe_vllm(url, timeout_s)
    except (Unavailable, FailedPrecondition) as vllm_err:
        log.debug("not vLLM at %s: %s", url, vllm_err)
        try:
            return _probe_sglang(url, timeout_s)
        except (Unavailable, FailedPrecondition) as sglang_err:
            raise FailedPrecondition(
                f"{url} answers neither like vLLM ({vllm_err}) nor like SGLang ({sglang_err})"
            ) from sglang_err
