"""The store's key layout: every prefix and every key the store reads or writes, in one place.

::

    config                          the store's signed identity (identity.py), written once
    chunks/<id[:2]>/<id>            chunk objects (codec.py), written once, named by content
    manifests/<workload>/<ckpt id>  signed manifest envelopes, created with if_absent
    locks/push-<ckpt id>            a push in flight (refreshed while it runs; locks.py)
    locks/gc-<gc id>                a gc run: started, swept, then its finish time (locks.py)
    migrations/<ckpt id>/<name>     signed records of the migration protocol (records.py)
    heads/<workload>/<sequence>     signed head records: a workload's newest checkpoint (heads.py)

Any other key is ignored by the store. Beside its keys, the root of a ``file://`` store holds
names that no key may take and no listing shows: the space reserve (``RESERVE_NAME``) and the
temp files a put writes before renaming them into place (``TEMP_PREFIX``).

Nothing else in ``storage/`` spells a prefix or builds a key; ``docs/design.md`` ("Key
layout") documents each. What any key may be (``validate_key``: relative ``/``-separated
segments, no ``.``/``..``/empty segment, no backslash, no control character) is checked here
for every backend alike; the grammar of the names keys are made of (checkpoint ids, workload
names) is the manifest's (``manifest.py``).
"""

from __future__ import annotations

from gpusnap.errors import InvalidArgument
from gpusnap.storage.manifest import check_workload, is_checkpoint_id, is_workload

# The store's identity: format version, random id, chunking and hashing (identity.py).
CONFIG_KEY = "config"
CHUNK_PREFIX = "chunks/"
MANIFEST_PREFIX = "manifests/"
LOCK_PREFIX = "locks/"
PUSH_LOCK_PREFIX = f"{LOCK_PREFIX}push-"
GC_RECORD_PREFIX = f"{LOCK_PREFIX}gc-"
# Signed records of the migration protocol (the daemon's board, through records.py).
MIGRATION_PREFIX = "migrations/"
# Signed per-workload head records, one per commit, created only if absent (heads.py).
HEAD_PREFIX = "heads/"
HEAD_SEQUENCE_DIGITS = 16
# The prefixes whose objects the store itself writes and interprets: no namespace of signed
# records may lie under (or over) one of them.
STORE_PREFIXES = (CONFIG_KEY, CHUNK_PREFIX, MANIFEST_PREFIX, LOCK_PREFIX, HEAD_PREFIX)

# In a ``file://`` store's root, never keys: the space reserve a gc releases on a full disk
# (docs/design.md, "gc and retention"), and the temp files of puts in flight.
RESERVE_NAME = ".gpusnap-reserve"
TEMP_PREFIX = ".gpusnap-tmp-"

CHUNK_ID_LENGTH = 64


def chunk_key(chunk_id: str) -> str:
    """``chunks/<id[:2]>/<id>``: the two-character fan-out keeps directories small."""
    return f"{CHUNK_PREFIX}{chunk_id[:2]}/{chunk_id}"


def chunk_list_prefixes(ways: int) -> list[str]:
    """Prefixes that split a listing of every chunk into ``ways`` (1 or 16) disjoint parts.

    ``chunks/<first hex digit>`` covers the 16 fan-out directories starting with it, so 16
    listings of about a sixteenth each can run at once.
    """
    if ways <= 1:
        return [CHUNK_PREFIX]
    return [f"{CHUNK_PREFIX}{digit}" for digit in "0123456789abcdef"]


def chunk_id_of_key(key: str) -> str | None:
    """The chunk id a key under ``chunks/`` names; ``None`` for any other key."""
    name = key.rpartition("/")[2]
    return name if key == chunk_key(name) and len(name) == CHUNK_ID_LENGTH else None


def manifest_key(workload: str, checkpoint_id: str) -> str:
    """``manifests/<workload>/<checkpoint id>``: where a checkpoint's manifest is stored."""
    return f"{MANIFEST_PREFIX}{workload}/{checkpoint_id}"


def manifest_prefix(workload: str | None = None) -> str:
    """The prefix listing every manifest, or (``InvalidArgument``-checked) one workload's."""
    return MANIFEST_PREFIX if workload is None else f"{MANIFEST_PREFIX}{check_workload(workload)}/"


def split_manifest_key(key: str) -> tuple[str, str] | None:
    """``(workload, checkpoint id)`` of a manifest key; ``None`` for any other key."""
    rest = key.removeprefix(MANIFEST_PREFIX)
    workload, _, checkpoint_id = rest.partition("/")
    # A workload name never contains '/', '.' alone or '..': anything else is not ours.
    if key == rest or not is_workload(workload) or not is_checkpoint_id(checkpoint_id):
        return None
    return workload, checkpoint_id


def head_key(workload: str, sequence: int) -> str:
    """``heads/<workload>/<sequence, 16 digits>``: so a listing sorts heads by sequence."""
    return f"{HEAD_PREFIX}{check_workload(workload)}/{sequence:0{HEAD_SEQUENCE_DIGITS}d}"


def head_prefix(workload: str) -> str:
    return f"{HEAD_PREFIX}{check_workload(workload)}/"


def head_sequence_of_key(key: str, workload: str) -> int | None:
    """The sequence a key under ``heads/<workload>/`` names; ``None`` for any other key."""
    name = key.removeprefix(head_prefix(workload))
    if name == key or len(name) != HEAD_SEQUENCE_DIGITS or not name.isdigit() or not name.isascii():
        return None
    return int(name)


def push_lock_key(checkpoint_id: str) -> str:
    """``locks/push-<checkpoint id>``: held while that checkpoint's push runs."""
    return f"{PUSH_LOCK_PREFIX}{checkpoint_id}"


def gc_record_key(gc_id: str) -> str:
    """``locks/gc-<gc id>``: one gc run's record."""
    return f"{GC_RECORD_PREFIX}{gc_id}"


def overlaps_store_prefix(prefix: str) -> bool:
    """Whether keys under ``prefix`` could be keys the store itself writes and reads."""
    return any(p.startswith(prefix) or prefix.startswith(p) for p in STORE_PREFIXES)


# --- what any key may be ------------------------------------------------------------------

# No key (and no store URL) holds one of these.
CONTROL_CHARS = frozenset(chr(c) for c in range(32)) | {"\x7f"}
MAX_KEY_LENGTH = 1024


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe object key, else raise ``InvalidArgument``.

    A key is ``/``-separated segments, relative, with no empty, ``.`` or ``..`` segment, no
    backslash and no control character. Every backend checks keys with this one function so
    that a key accepted by one store is accepted by all, and none can name a path outside a
    ``file://`` root.
    """
    _check_path_like(key, what="key")
    if key.endswith("/"):
        raise InvalidArgument(f"invalid store key {key!r}: ends with '/'")
    return key


def is_valid_key(key: str) -> bool:
    """Whether ``validate_key`` accepts ``key``: a listing skips (and logs) any other name."""
    try:
        validate_key(key)
    except InvalidArgument:
        return False
    return True


def validate_prefix(prefix: str) -> str:
    """Like ``validate_key`` for a listing prefix: may be empty and may end with ``/``."""
    if prefix == "":
        return prefix
    _check_path_like(prefix.removesuffix("/"), what="prefix")
    return prefix


def _check_path_like(value: str, *, what: str) -> None:
    if not isinstance(value, str) or value == "":
        raise InvalidArgument(f"invalid store {what} {value!r}: empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_KEY_LENGTH:
        raise InvalidArgument(f"invalid store {what}: longer than {MAX_KEY_LENGTH} bytes")
    if value.startswith("/"):
        raise InvalidArgument(f"invalid store {what} {value!r}: absolute")
    if "\\" in value:
        raise InvalidArgument(f"invalid store {what} {value!r}: contains a backslash")
    if any(ch in CONTROL_CHARS for ch in value):
        raise InvalidArgument(f"invalid store {what} {value!r}: contains a control character")
    for segment in value.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidArgument(
                f"invalid store {what} {value!r}: empty, '.' or '..' path segment"
            )
