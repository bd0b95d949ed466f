"""A tiny HTTP/1.1 client for instance metadata services, and the ``Endpoint`` each watcher asks.

Metadata endpoints are plain ``http://`` on a link-local address. This client deliberately
ignores proxy environment variables (a proxy cannot reach 169.254.169.254 and must not see
IMDS tokens), never follows redirects, bounds every call by a total deadline and caps the
body it reads, so a slow or garbage-spewing service costs one timeout, never a hang.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit

from gpusnap.errors import Corrupt, InvalidArgument, Unavailable

MAX_BODY = 256 * 1024


def epoch_seconds(dt: datetime, no_zone: str) -> float:
    """A time a metadata service answered, as epoch seconds; ``Corrupt(no_zone)`` when it has
    no zone (its epoch would be a guess in the node's local time)."""
    if dt.tzinfo is None:
        raise Corrupt(no_zone)
    return dt.timestamp()


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def check_base_url(url: str, *, what: str) -> str:
    """Return ``url`` without a trailing slash if it is ``http://host[:port]``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise InvalidArgument(f"{what} {url!r} must be an http://host[:port] URL")
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise InvalidArgument(f"{what} {url!r} must not carry a path or query")
    try:
        _ = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"{what} {url!r} has an invalid port") from exc
    return url.rstrip("/")


def request(
    method: str,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    timeout: float,
) -> Response:
    """Send one request; raise ``Unavailable`` on any transport failure or timeout."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(host, parts.port or 80, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        chunks: list[bytes] = []
        size = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"{method} {url}: no complete answer within {timeout:g} s")
            if conn.sock is not None:
                conn.sock.settimeout(remaining)
            chunk = resp.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_BODY:
                raise Unavailable(f"{method} {url}: answer larger than {MAX_BODY} bytes")
            chunks.append(chunk)
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        return Response(resp.status, hdrs, b"".join(chunks))
    except TimeoutError as exc:
        raise Unavailable(f"{method} {url}: timed out after {timeout:g} s") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise Unavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
    finally:
        conn.close()


class Endpoint:
    """One metadata service: its base URL, the headers every request to it carries (GCP's
    ``Metadata-Flavor``, Azure's ``Metadata``) and how long one request may take."""

    def __init__(
        self, base_url: str, timeout: float, headers: Mapping[str, str] | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = dict(headers or {})

    def call(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        timeout: float | None = None,
    ) -> Response:
        """One request to ``path`` (with its query); ``Unavailable`` as ``request``."""
        return request(
            method,
            self.base_url + path,
            headers={**self.headers, **(headers or {})},
            body=body,
            timeout=self.timeout if timeout is None else timeout,
        )

    def answers(
        self,
        path: str,
        accept: Callable[[Response], bool],
        *,
        method: str = "GET",
        headers: Mapping[str, str] | None = None,
    ) -> bool:
        """True if the service answers ``path`` and ``accept`` takes the reply: the
        ``auto`` probe of a provider. A service that does not answer is simply not there."""
        try:
            resp = self.call(method, path, headers=headers)
        except Unavailable:
            return False
        return accept(resp)
