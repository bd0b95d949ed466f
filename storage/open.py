"""Opening a store's backend from its URL: the scheme picks the factory, ``RetryingBackend``
wraps what it returns.

Apart from ``backend.py`` (the protocol and the scheme registry) because it needs both the
protocol and ``retry.py``, which itself needs the protocol.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from gpusnap.errors import InvalidArgument
from gpusnap.storage.backend import Backend, BackendOptions, backend_factory, registered_schemes
from gpusnap.storage.layout import CONTROL_CHARS
from gpusnap.storage.retry import RetryingBackend


def open_backend(url: str, options: BackendOptions | None = None) -> Backend:
    """Open the store at ``url`` (``file:///abs/path`` or ``s3://bucket/prefix``).

    The backend comes wrapped in a ``RetryingBackend`` configured from ``options``.
    A malformed URL (control characters, no scheme, a query or fragment) or an unknown
    scheme raises ``InvalidArgument``; the backend's factory checks the rest.
    """
    options = options or BackendOptions()
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument("store URL is empty; expected file:///path or s3://bucket/prefix")
    if any(ch in url for ch in CONTROL_CHARS):
        raise InvalidArgument(f"store URL {url!r} contains control characters")
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        raise InvalidArgument(
            f"store URL {url!r} has no scheme; expected file:///path or s3://bucket/prefix"
        )
    scheme = scheme.lower()
    factory = backend_factory(scheme)
    if factory is None:
        raise InvalidArgument(
            f"store URL {url!r} has unknown scheme {scheme!r}; "
            f"supported: {', '.join(registered_schemes())}"
        )
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise InvalidArgument(f"store URL {url!r} may not carry a query or fragment")
    inner = factory(url, options)
    return RetryingBackend(
        inner,
        attempts=options.retry_attempts,
        base_delay=options.retry_base_delay,
        max_delay=options.retry_max_delay,
        deadline=options.retry_deadline,
    )
