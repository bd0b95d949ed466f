"""Reading what a store holds before it is authenticated: capped in size, parsed totally.

Anyone who can write to the store can put any bytes under any key, and a node reads some of
them before any signature is checked (the envelope around a manifest, the store config, the
coordination records under ``locks/``, chunk headers). Everything read that way goes through
here: ``read_capped`` never reads more than a limit (a ranged GET on S3), and ``load_json``
turns every way a JSON text can fail -- bad UTF-8, nesting deep enough to exhaust the
interpreter's stack, a lone surrogate that cannot be encoded again, ``NaN``, a number too
large for any field -- into ``Corrupt`` naming the object, so that a bad object is an
integrity error (exit 4) and never a crash, a hang or a memory spike.

The limits are part of the store format (docs/design.md, "Size limits").
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

from gpusnap.errors import Corrupt


class _Readable(Protocol):
    """What ``read_capped`` needs of a backend (``backend.Backend``, which imports what uses
    this module, so it is not imported here)."""

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes: ...


KiB = 1024
MiB = 1024 * KiB
# The store config is a few hundred bytes.
MAX_CONFIG_BYTES = 64 * KiB
# A manifest lists every chunk of a checkpoint (about 80 bytes of JSON each, a third more in
# its envelope): 256 MiB holds several million chunks, terabytes of checkpoint.
MAX_MANIFEST_BYTES = 256 * MiB
# Signed records and coordination records (``locks/``) are a few hundred bytes.
MAX_RECORD_BYTES = 1 * MiB
# JSON nesting that no object we write comes near; deeper is refused before any recursion.
MAX_JSON_DEPTH = 64
# No number in any object we write is larger (sizes, offsets, times are well below 2**64).
MAX_JSON_INT = 2**64


def read_capped(backend: _Readable, key: str, limit: int, what: str) -> bytes:
    """The object at ``key``, at most ``limit`` bytes of it read; ``Corrupt`` if it is larger.

    One byte past the limit is asked for (a ranged read), so that an object of exactly
    ``limit`` bytes is told apart from a larger one without reading the rest.
    """
    data = backend.get(key, length=limit + 1)
    if len(data) > limit:
        raise Corrupt(f"{what} is larger than the {limit} bytes it may be; refused unread")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(blob: bytes, what: str, *, envelope: str | None = None) -> Any:
    """``blob`` parsed as strict JSON (UTF-8), or ``Corrupt`` naming ``what`` and why.

    Refused: invalid UTF-8; ``NaN``/``Infinity``; a float that overflows; an integer beyond
    ``MAX_JSON_INT``; nesting deeper than ``MAX_JSON_DEPTH``; a string (or key) holding a
    lone surrogate (it would fail later, wherever it is encoded or printed). ``envelope``
    names the envelope format ``blob`` should be, for the message.
    """
    problem = _json_problem(blob)
    if isinstance(problem, _Problem):
        if envelope is not None:
            raise Corrupt(f"{what} is not a readable {envelope} envelope: {problem.why}")
        raise Corrupt(f"{what} is not readable: {problem.why}")
    return problem


class _Problem:
    def __init__(self, why: str) -> None:
        self.why = why


def _json_problem(blob: bytes) -> Any:
    """The parsed value, or a ``_Problem`` saying what is wrong with it."""
    try:
        value = json.loads(blob.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        return _Problem(f"nested deeper than {MAX_JSON_DEPTH} levels")
    except UnicodeDecodeError:
        return _Problem("not UTF-8")
    except ValueError:  # JSONDecodeError, an integer too long to convert, NaN
        return _Problem("not JSON")
    # Iterative: a recursive walk is what the deep nesting attacks.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list) and depth > MAX_JSON_DEPTH:
            return _Problem(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            for key, inner in item.items():
                if not _is_unicode(key):
                    return _Problem("a string that is not valid Unicode")
                stack.append((inner, depth + 1))
        elif isinstance(item, list):
            stack.extend((inner, depth + 1) for inner in item)
        elif isinstance(item, str):
            if not _is_unicode(item):
                return _Problem("a string that is not valid Unicode")
        elif isinstance(item, float):
            if not math.isfinite(item):
                return _Problem("a number out of range")
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_JSON_INT:
            return _Problem("a number out of range")
    return value


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: object, limit: int = 80) -> str:
    """``text`` fit for one line of a message: anything not printable escaped, cut at ``limit``.

    For anything a store supplied that is shown before it is authenticated (a ``key_id``):
    a terminal escape in it must reach no terminal.
    """
    raw = str(text)
    out = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in raw[:limit]
    )
    return out + ("..." if len(raw) > limit else "")
