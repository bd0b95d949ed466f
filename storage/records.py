"""Signed records: small JSON objects other parts keep in the store, authenticated on read.

A record lives at ``<prefix><name>`` (the migration protocol's prefix is
``layout.MIGRATION_PREFIX``; none may lie under the store's own prefixes). It is written once:
``create`` is a conditional put (``If-None-Match: *`` on S3, ``link(2)`` on ``file://``), so of
two writers of one name exactly one succeeds and the other gets ``AlreadyExists``. Its bytes
are the canonical JSON of the object, sealed like a manifest (``keys.seal``, format
``gpusnap.record/1``): signed with the store's signing key, and encrypted when the store has
an encryption key. ``read`` refuses, as ``Corrupt``, a record that is unsigned, signed by
another key, altered, not JSON or not an object, so that whoever can write to the store but
lacks the key cannot make a node act on a record.

What the fields of a record mean (and whether a record names what its key says) is the
caller's: a record that opens is authentic, not necessarily well formed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpusnap.errors import Corrupt, FailedPrecondition, InvalidArgument
from gpusnap.storage.context import StoreContext
from gpusnap.storage.keys import StoreKeys
from gpusnap.storage.layout import overlaps_store_prefix, validate_key, validate_prefix
from gpusnap.storage.untrusted import MAX_RECORD_BYTES, load_json, read_capped

RECORD_FORMAT = "gpusnap.record/1"


def seal_record(keys: StoreKeys, payload: bytes) -> bytes:
    """``payload`` sealed as a record; a store without a signing key cannot make one."""
    if keys.signer is None:
        raise FailedPrecondition("signing needs a signing key file")
    return keys.seal(RECORD_FORMAT, payload)


def open_record(keys: StoreKeys, blob: bytes, what: str = "signed record") -> bytes:
    """The payload of a record made by ``seal_record``, its signature always checked."""
    return keys.unseal(blob, RECORD_FORMAT, what=what, verify=True)


class SignedRecords:
    """The signed records under one prefix of a store (``CheckpointStore.records``)."""

    def __init__(self, ctx: StoreContext, prefix: str) -> None:
        if not prefix.endswith("/") or prefix == "/":
            raise InvalidArgument(f"a records prefix ends with '/': {prefix!r}")
        validate_prefix(prefix)
        if overlaps_store_prefix(prefix):
            raise InvalidArgument(f"records under {prefix!r} would mix with the store's own keys")
        self._ctx = ctx
        self.prefix = prefix

    def key(self, name: str) -> str:
        """The store key of record ``name`` (``InvalidArgument`` if it makes no valid key)."""
        return validate_key(f"{self.prefix}{name}")

    def create(self, name: str, record: Mapping[str, Any]) -> None:
        """Write ``record`` as ``name`` unless that exists (then ``AlreadyExists``).

        A retried put whose first attempt landed is told apart by its bytes (``retry.py``),
        so a record that two writers could make identical should carry something unique to
        its writer (a nonce).
        """
        payload = json.dumps(dict(record), sort_keys=True, separators=(",", ":")).encode()
        blob = seal_record(self._ctx.keys, payload)
        self._ctx.backend.put(self.key(name), blob, if_absent=True)

    def read(self, name: str) -> dict[str, Any]:
        """Record ``name``, authenticated: ``NotFound``, or ``Corrupt`` unless it holds."""
        key = self.key(name)
        what = f"signed record {key}"
        blob = read_capped(self._ctx.backend, key, MAX_RECORD_BYTES, what)
        record = load_json(open_record(self._ctx.keys, blob, what), what)
        if not isinstance(record, dict):
            raise Corrupt(f"signed record {key} is not a JSON object")
        return record

    def names(self, under: str = "") -> list[str]:
        """The names of the records under ``prefix + under``, in key order (valid or not)."""
        prefix = f"{self.prefix}{under}"
        validate_prefix(prefix)
        return [info.key[len(self.prefix) :] for info in self._ctx.backend.list(prefix)]

    def delete(self, name: str) -> None:
        """Remove record ``name`` (a missing one is not an error)."""
        self._ctx.backend.delete(self.key(name))
