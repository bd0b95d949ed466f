"""Checked access to one TOML table of the config: keys consumed one by one, each read as the
type it must be, and ``done()`` refusing whatever is left.

Every problem is an ``InvalidArgument`` whose one-line message names the table and the key, and
``done()`` suggests the closest known key for a misspelt one.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpusnap.daemon.infra.numbers import MAX_INTEGER, MAX_NUMBER, is_finite_number
from gpusnap.errors import InvalidArgument


class Table:
    """A TOML table whose keys are consumed one by one; ``done()`` rejects what is left."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data = data
        self.where = where
        self.used: set[str] = set()

    def get(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key)

    def bad(self, key: str, what: str) -> InvalidArgument:
        value = self.data.get(key)
        return InvalidArgument(f"{self.where}: key '{key}': {what} (got {value!r})")

    def _missing(self, key: str) -> InvalidArgument:
        return InvalidArgument(f"{self.where}: missing key '{key}'")

    def string(self, key: str, *, required: bool = False) -> str | None:
        v = self.get(key)
        if v is None:
            if required:
                raise self._missing(key)
            return None
        if not isinstance(v, str) or not v:
            raise self.bad(key, "must be a non-empty string")
        if "\0" in v:  # no path, name or URL holds one; the OS would refuse it later
            raise self.bad(key, "must not contain a NUL character")
        return v

    def choice(self, key: str, allowed: tuple[str, ...]) -> str | None:
        v = self.string(key)
        if v is not None and v not in allowed:
            raise self.bad(key, f"must be one of {', '.join(allowed)}")
        return v

    def path(self, key: str, *, required: bool = False) -> Path | None:
        v = self.string(key, required=required)
        if v is None:
            return None
        if not v.startswith("/"):
            raise self.bad(key, "must be an absolute path")
        return Path(v)

    def host_port(self, key: str, *, required: bool = False) -> str | None:
        v = self.string(key, required=required)
        if v is None:
            return None
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise self.bad(key, "must be HOST:PORT")
        return v

    def integer(
        self, key: str, *, minimum: int | None = None, maximum: int = MAX_INTEGER
    ) -> int | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.bad(key, "must be an integer")
        if minimum is not None and v < minimum:
            raise self.bad(key, f"must be at least {minimum}")
        if v > maximum:
            raise self.bad(key, f"must be at most {maximum}")
        return v

    def number(
        self, key: str, *, minimum: float | None = None, maximum: float = MAX_NUMBER
    ) -> float | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise self.bad(key, "must be a number")
        if not is_finite_number(v):  # TOML has nan and inf; no key means either
            raise self.bad(key, "must be a finite number")
        if minimum is not None and v < minimum:
            raise self.bad(key, f"must be at least {minimum}")
        if v > maximum:
            raise self.bad(key, f"must be at most {maximum:g}")
        return float(v)

    def boolean(self, key: str) -> bool | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise self.bad(key, "must be true or false")
        return v

    def string_list(self, key: str, *, required: bool = False) -> list[str] | None:
        v = self.get(key)
        if v is None:
            if required:
                raise self._missing(key)
            return None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.bad(key, "must be a list of strings")
        return list(v)

    def string_map(self, key: str) -> dict[str, str] | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
            raise self.bad(key, "must be a table of strings")
        return dict(v)

    def raw_table(self, key: str) -> dict[str, Any]:
        v = self.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise self.bad(key, "must be a table")
        return dict(v)

    def table(self, key: str, *, optional: bool = False) -> Any:
        v = self.get(key)
        where = f"config: [{key}]" if self.where == "config" else f"{self.where} {key}"
        if v is None:
            return None if optional else Table({}, where)
        if not isinstance(v, dict):
            raise self.bad(key, "must be a table")
        return Table(v, where)

    def array_of_tables(self, key: str) -> list[Table]:
        v = self.get(key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
            raise self.bad(key, f"must be an array of tables ([[{key}]])")
        return [Table(x, f"config: [[{key}]] #{i}") for i, x in enumerate(v, start=1)]

    def done(self) -> None:
        for key in self.data:
            if key not in self.used:
                hint = difflib.get_close_matches(key, sorted(self.used), n=1, cutoff=0.6)
                suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
                where = self.where
                if where == "config":
                    raise InvalidArgument(f"config: unknown section or key '{key}'{suggestion}")
                raise InvalidArgument(f"{where}: unknown key '{key}'{suggestion}")
