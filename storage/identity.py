"""The store's identity: a small signed config object, written once when the store is made.

``config`` (``layout.CONFIG_KEY``) holds the store format version, a random store id, when
the store was made, and the parameters every writer must share for chunks to dedup and be
readable: the FastCDC sizes, the chunk-id hash and whether ids are keyed (with which
encryption key). It is sealed like a manifest (``keys.seal``, format ``gpusnap.config/1``),
signed and never encrypted: every node that opens the store must read it, and it holds
nothing secret (the encryption key id is a one-way derivation of the key).

Who writes it: a push into a store that has none (a new store, or one made before this
object existed: the migration is "the first push writes it"), with ``if_absent``, so of two
nodes creating a store at once exactly one writes it and the other reads the winner's. It is
never rewritten. Who trusts it: a node whose signature check accepts its signer (its own key
or a trusted one, ``keys.StoreKeys``). A config that is altered, unsigned, or signed by a key
the node does not trust is *not used*, loudly (a warning on every open; ``verify`` reports
it): its chunk sizes and encryption claims are ignored (the node cuts with its own), and its
store id is not believed -- the index is keyed by a digest of the config object instead, so
any change to it still empties the index. A store writer without a trusted key therefore
cannot steer what nodes do by swapping the config; the worst it gains is what deleting
objects gains anyway (an index rebuild). Correctness never rests on the config: every push
proves the chunks it skips (``confirm.py``). A config signed by a retired key that is no
longer trusted is the same case (docs/design.md, "Rotating a key").

What the identity is for is ``confirm.py``: the local chunk index records the id of the
store it describes, and is emptied and rebuilt when the store's id is another (or gone).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from gpusnap.errors import (
    AlreadyExists,
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    NotFound,
    Unsupported,
)
from gpusnap.storage.backend import Backend
from gpusnap.storage.chunker import MAX_SIZE, ChunkerParams
from gpusnap.storage.keys import StoreKeys
from gpusnap.storage.layout import CONFIG_KEY
from gpusnap.storage.untrusted import MAX_CONFIG_BYTES, load_json, read_capped

log = logging.getLogger(__name__)

CONFIG_FORMAT = "gpusnap.config/1"
# The store format this code reads and writes (docs/design.md: "Store format version").
STORE_FORMAT_VERSION = 1
CHUNK_HASH = "blake3-256"
CHUNKING = "fastcdc"
STORE_ID_BYTES = 16


@dataclass(frozen=True)
class StoreIdentity:
    """What a store's config object says; ``store_id`` keys every node's chunk index."""

    store_id: str
    created_at: float
    chunking: ChunkerParams
    keyed: bool  # chunk ids are keyed BLAKE3 (the store is encrypted)
    encryption_key_id: str | None
    format_version: int = STORE_FORMAT_VERSION
    chunk_hash: str = CHUNK_HASH
    signed_by: str | None = None  # the key id on the envelope (not part of the payload)

    def payload(self) -> bytes:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "store_id": self.store_id,
            "created_at": self.created_at,
            "chunking": {
                "algorithm": CHUNKING,
                "min_size": self.chunking.min_size,
                "avg_size": self.chunking.avg_size,
                "max_size": self.chunking.max_size,
            },
            "chunk_id": {
                "hash": self.chunk_hash,
                "keyed": self.keyed,
                "encryption_key_id": self.encryption_key_id,
            },
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, payload: bytes, signed_by: str | None) -> StoreIdentity:
        """The identity in a config payload; ``Corrupt`` if malformed, ``Unsupported`` if it
        is a format (or a chunking or hash) this code does not know."""
        body = load_json(payload, "store config")
        try:
            version = body["format_version"]
            store_id = body["store_id"]
            created_at = float(body["created_at"])
            chunking = body["chunking"]
            chunk_id = body["chunk_id"]
            params = ChunkerParams(
                int(chunking["min_size"]), int(chunking["avg_size"]), int(chunking["max_size"])
            )
            algorithm, hash_name = chunking["algorithm"], chunk_id["hash"]
            keyed, enc_id = chunk_id["keyed"], chunk_id["encryption_key_id"]
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise Corrupt(f"store config is not a readable {CONFIG_FORMAT} object") from exc
        if not math.isfinite(created_at):
            raise Corrupt("store config has a created_at that is not a time")
        if not isinstance(version, int) or version != STORE_FORMAT_VERSION:
            raise Unsupported(
                f"store format version {version!r}; this gpusnap reads version "
                f"{STORE_FORMAT_VERSION} (upgrade gpusnap)"
            )
        if algorithm != CHUNKING or hash_name != CHUNK_HASH:
            raise Unsupported(f"store uses chunking {algorithm!r} with hash {hash_name!r}")
        if not (0 < params.min_size <= params.avg_size <= params.max_size <= MAX_SIZE):
            raise Unsupported(f"store chunk sizes {params} are outside what this gpusnap reads")
        if not (isinstance(store_id, str) and len(store_id) == 2 * STORE_ID_BYTES):
            raise Corrupt(f"store config has an invalid store id {store_id!r}")
        try:
            int(store_id, 16)
        except ValueError as exc:
            raise Corrupt(f"store config has an invalid store id {store_id!r}") from exc
        if not isinstance(keyed, bool) or not (enc_id is None or isinstance(enc_id, str)):
            raise Corrupt("store config has an invalid chunk_id section")
        return cls(store_id, created_at, params, keyed, enc_id, version, hash_name, signed_by)

    def check_writer(self, keys: StoreKeys) -> None:
        """Refuse a writer whose chunks would not be this store's (other ids, unreadable)."""
        have = keys.encryption.key_id if keys.encryption is not None else None
        if self.keyed and have != self.encryption_key_id:
            raise FailedPrecondition(
                f"this store's chunks are encrypted and named with encryption key "
                f"{self.encryption_key_id}; this node has "
                f"{'key ' + have if have else 'no encryption key'}: pushing would write chunks "
                "other nodes cannot read"
            )
        if not self.keyed and have is not None:
            raise FailedPrecondition(
                "this store is not encrypted (its config says so); pushing with an encryption "
                "key would mix chunk names. Use a new store for encrypted checkpoints"
            )


@dataclass(frozen=True)
class IdentityRead:
    """What reading ``config`` found: an identity, nothing (``None``, ``None``), or a config
    that cannot be used and why (``None``, the error); ``digest`` names the object's bytes."""

    identity: StoreIdentity | None
    problem: GpusnapError | None = None
    digest: str | None = None

    @property
    def index_key(self) -> str | None:
        """What the local index is bound to: the store id of an authenticated config, else
        the digest of whatever config object is there (``None``: there is none)."""
        if self.identity is not None:
            return self.identity.store_id
        return None if self.digest is None else f"unverified-{self.digest}"


def new_identity(keys: StoreKeys, params: ChunkerParams) -> StoreIdentity:
    return StoreIdentity(
        store_id=secrets.token_hex(STORE_ID_BYTES),
        created_at=time.time(),
        chunking=params,
        keyed=keys.encryption is not None,
        encryption_key_id=keys.encryption.key_id if keys.encryption is not None else None,
        signed_by=keys.signer.key_id if keys.signer is not None else None,
    )


def read_identity(backend: Backend, keys: StoreKeys) -> IdentityRead:
    """One GET of ``config``, opened with the store's keys (see the module docstring)."""
    try:
        blob = read_capped(backend, CONFIG_KEY, MAX_CONFIG_BYTES, "store config")
    except NotFound:
        return IdentityRead(None)
    except Corrupt as exc:  # too large, or not a file: not used, like any bad config
        log.warning("%s: the store config is not used (%s)", backend.url, exc)
        return IdentityRead(None, exc, f"unreadable-{type(exc).__name__}")
    digest = blake3(blob).hexdigest()[:32]
    try:
        payload = keys.unseal(blob, CONFIG_FORMAT, what="store config")
        return IdentityRead(StoreIdentity.parse(payload, _signer_of(blob)), digest=digest)
    except (Corrupt, FailedPrecondition, Unsupported) as exc:
        log.warning(
            "%s: the store config is not used (%s); this node cuts with its own chunk sizes "
            "and keys its index by the config object's digest",
            backend.url,
            exc,
        )
        return IdentityRead(None, exc, digest)


def _signer_of(blob: bytes) -> str | None:
    try:
        envelope = load_json(blob, "store config")
    except Corrupt:
        return None
    key_id = envelope.get("key_id") if isinstance(envelope, dict) else None
    return key_id if isinstance(key_id, str) else None


def create_identity(backend: Backend, keys: StoreKeys, params: ChunkerParams) -> StoreIdentity:
    """Write a new ``config`` unless one exists; either way, the store's identity.

    Of two writers at once exactly one creates it (``if_absent``); the other reads the
    winner's, which must then pass its own checks like any config.
    """
    keys.check_can_push()
    identity = new_identity(keys, params)
    try:
        backend.put(CONFIG_KEY, keys.seal(CONFIG_FORMAT, identity.payload()), if_absent=True)
    except AlreadyExists:
        found = read_identity(backend, keys)
        if found.identity is None:
            gone = NotFound("the store config vanished while it was being created")
            raise (found.problem or gone) from None
        return found.identity
    log.info("%s: new store identity %s", backend.url, identity.store_id)
    return identity


class IdentityCell:
    """The identity an open store knows: read at open, set again by each push (which reads
    ``config`` afresh, or writes it). Thread-safe; ``problem`` says why a config found at
    open is not used."""

    def __init__(self, found: IdentityRead) -> None:
        self._lock = threading.Lock()
        self._found = found

    def get(self) -> StoreIdentity | None:
        with self._lock:
            return self._found.identity

    @property
    def problem(self) -> GpusnapError | None:
        with self._lock:
            return self._found.problem

    def set(self, found: IdentityRead) -> None:
        with self._lock:
            self._found = found
