"""A logging filter that keeps credentials out of every log line.

At debug level botocore and urllib3 log whole requests: the ``Authorization`` header (its
credential scope and signature), ``X-Amz-Security-Token`` (a session token that *is* a
credential), canonical requests, sometimes the credentials themselves. gpusnap's entry
points install ``RedactSecrets`` on the handlers they configure (``gpusnap -vv``,
``gpusnapd --log-level debug``), so no such value reaches stderr or the journal: every
record is formatted once here and the values after the names below are replaced, and so is
any literal credential taken from the environment.
"""

from __future__ import annotations

import logging
import os
import re

REDACTED = "<redacted>"

# A name that carries a credential, then ``:`` or ``=`` (quoted or not, a ``b'`` bytes repr
# too), then the value, up to a quote, a space, a comma, ``&`` or a closing brace.
_NAMED = re.compile(
    r"(?i)(\b(?:x-amz-security-token|authorization|aws_secret_access_key|aws_session_token|"
    r"aws_security_token|secretaccesskey|sessiontoken|secret_key|token|x-amz-signature|"
    r"x-amz-credential|signature|credential)['\"]?\s*[:=]\s*b?['\"]?)([^'\"\s,&}]+)"
)
# Environment variables whose values are credentials wherever they appear.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
# Values shorter than this are not worth hunting for literally (and would match by chance).
_MIN_LITERAL = 8


def redact(text: str, literals: tuple[str, ...] = ()) -> str:
    """``text`` with every credential value replaced by ``<redacted>``."""
    for literal in literals:
        text = text.replace(literal, REDACTED)
    return _NAMED.sub(lambda m: m.group(1) + REDACTED, text)


class RedactSecrets(logging.Filter):
    """Rewrites each record's message with its credentials redacted (never drops one)."""

    def __init__(self) -> None:
        super().__init__()
        self._literals = tuple(
            v for name in _SECRET_ENV if len(v := os.environ.get(name, "")) >= _MIN_LITERAL
        )

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in someone's log call: leave it to logging
            return True
        cleaned = redact(message, self._literals)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True
