"""Key files: the Ed25519 signing keys that authenticate manifests, and the encryption key.

Two kinds of file, two jobs:

- a **signing key** is an Ed25519 key in PEM. Each node that pushes holds its own private key
  (``gpusnap store keygen`` writes it and its public half beside it, ``KEY.pub``); a node that
  only restores may hold just a public key and can then read and verify but not push. What a
  node accepts is its own key plus its **trusted keys** (public keys, files or directories of
  ``*.pub``): an envelope names the key that signed it (``key_id``), and one signed by a key
  outside that set is refused (``UntrustedSigner``, exit 4) -- which is how a retired or
  stolen key is revoked (docs/design.md, "Threat model");
- the **encryption key** is 32 random bytes. Everything secret is derived from it with
  BLAKE3's key-derivation mode, one context string per use, so the chunk-naming key, the
  chunk cipher key and the manifest cipher key are independent.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blake3 import blake3
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpusnap.errors import Corrupt, FailedPrecondition, InvalidArgument, NotFound
from gpusnap.storage.untrusted import load_json, printable

log = logging.getLogger(__name__)

ENCRYPTION_KEY_BYTES = 32
NONCE_BYTES = 12
_CTX_CHUNK_ID = "gpusnap 2026-11 chunk id"
_CTX_CHUNK_DATA = "gpusnap 2026-11 chunk data"
_CTX_RECORD_DATA = "gpusnap 2026-11 record data"


def _write_secret(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 from the start (never world-readable, not even briefly)."""
    _write_new_file(path, data, 0o600, "key file", "already exists")


def _write_new_file(path: Path, data: bytes, mode: int, what: str, exists: str) -> None:
    """Create ``path`` with ``mode`` (O_EXCL: never overwrite a key), write and fsync ``data``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as exc:
        raise InvalidArgument(f"{what} {path} {exists}; refusing to overwrite") from exc
    except OSError as exc:
        raise InvalidArgument(f"cannot create {what} {path}: {exc.strerror}") from exc
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


# No key file we read is anywhere near this; a larger one is not a key.
_MAX_KEY_FILE_BYTES = 64 * 1024


def _read_key_file(path: Path, what: str) -> tuple[bytes, os.stat_result]:
    """The bytes of a key file and its status (``NotFound``, ``InvalidArgument``).

    What the file holds decides how it is checked (``check_secret_file``,
    ``check_public_file``), the way ssh checks its keys before using them.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise NotFound(f"{what} file {path} does not exist") from exc
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{what} file {path} is not a regular file")
        data = os.read(fd, _MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise InvalidArgument(f"{what} file {path} is too large to be a key")
    return data, st


def check_secret_file(path: Path, st: os.stat_result, what: str) -> None:
    """Refuse a secret key file that others may read, or that is not the reader's own."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InvalidArgument(
            f"{what} file {path} is mode {mode:04o}; must not be readable by group or others "
            "(chmod 600)"
        )
    if st.st_uid != os.geteuid():
        raise InvalidArgument(
            f"{what} file {path} is owned by uid {st.st_uid}, not by the user reading it "
            f"(uid {os.geteuid()}); chown it to that user"
        )


def check_public_file(path: Path, st: os.stat_result, what: str) -> None:
    """Refuse a public key file (one this node trusts) that others may swap, or plant."""
    check_trusted_path(f"{what} file {path}", st)
    try:
        parent = os.stat(path.parent)
    except OSError as exc:
        raise InvalidArgument(f"cannot check {what} file {path}: {exc.strerror}") from exc
    check_trusted_path(f"directory {path.parent} of {what} file {path.name}", parent)


def check_trusted_path(label: str, st: os.stat_result) -> None:
    """Refuse a trusted key file or directory that anyone but root or its reader may change."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise InvalidArgument(
            f"{label} is mode {mode:04o}; must not be writable by group or others (chmod go-w)"
        )
    if st.st_uid not in (0, os.geteuid()):
        raise InvalidArgument(
            f"{label} is owned by uid {st.st_uid}; only root or the user reading it "
            f"(uid {os.geteuid()}) may own it"
        )


def generate_signing_key(path: Path) -> None:
    """Write a new Ed25519 private key to ``path`` (PEM, PKCS#8, mode 0600)."""
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_secret(path, pem)


def generate_encryption_key(path: Path) -> None:
    """Write 32 random bytes to ``path`` (mode 0600)."""
    _write_secret(path, secrets.token_bytes(ENCRYPTION_KEY_BYTES))


def export_public_key(private_key_file: Path, path: Path) -> None:
    """Write the public half of a signing key, for nodes that only verify or trust it."""
    pem = load_signing_key(private_key_file).public_pem()
    _write_new_file(path, pem, 0o644, "public key file", "exists")


def public_key_path(private_key_file: Path) -> Path:
    """Where ``gpusnap store keygen`` writes a key's public half: ``KEY.pub`` beside ``KEY``."""
    return private_key_file.with_name(private_key_file.name + ".pub")


@dataclass(frozen=True)
class KeyScope:
    """What a trusted key may sign: workloads (``fnmatch`` patterns) and nodes (the stamp's
    ``host.node_id``); ``None`` leaves that side open. Read from ``<key file>.scope``."""

    workloads: tuple[str, ...] | None = None
    nodes: tuple[str, ...] | None = None

    def refusal(self, workload: str, node: str | None) -> str | None:
        """Why a record of ``workload`` made on ``node`` is outside this scope, or ``None``."""
        if self.workloads is not None and not any(
            fnmatch.fnmatchcase(workload, p) for p in self.workloads
        ):
            return f"workload {workload} is not in its scope (workloads={','.join(self.workloads)})"
        if self.nodes is not None and (
            node is None or not any(fnmatch.fnmatchcase(node, p) for p in self.nodes)
        ):
            return f"node {node or '(none)'} is not in its scope (nodes={','.join(self.nodes)})"
        return None


SCOPE_SUFFIX = ".scope"


def load_scope(key_path: Path) -> KeyScope | None:
    """The scope in ``<key_path>.scope`` (lines ``workloads = a,b`` / ``nodes = x``, ``#``
    comments); ``None`` when there is no such file (the key signs any workload)."""
    path = key_path.with_name(key_path.name + SCOPE_SUFFIX)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read key scope {path}: {exc}") from exc
    found: dict[str, tuple[str, ...]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        names = tuple(v.strip() for v in value.split(",") if v.strip())
        if not sep or name not in ("workloads", "nodes") or name in found or not names:
            raise InvalidArgument(
                f"key scope {path} line {number}: expected one 'workloads = A,B' and/or "
                "'nodes = X,Y' line, each naming at least one"
            )
        found[name] = names
    if not found:
        raise InvalidArgument(f"key scope {path} names no workloads or nodes")
    return KeyScope(found.get("workloads"), found.get("nodes"))


def envelope_key_id(blob: bytes) -> str | None:
    """The ``key_id`` an envelope names (unauthenticated: use it after ``unseal`` passed)."""
    try:
        envelope = json.loads(blob)
    except (ValueError, RecursionError):
        return None
    key_id = envelope.get("key_id") if isinstance(envelope, dict) else None
    return key_id if isinstance(key_id, str) else None


@dataclass(frozen=True)
class SigningKey:
    """An Ed25519 key; ``private_key`` is ``None`` on verify-only nodes. ``scope`` limits
    what a trusted key's signature is accepted for (``KeyScope``); a node's own key has none."""

    public_key: Ed25519PublicKey
    private_key: Ed25519PrivateKey | None
    scope: KeyScope | None = None

    @property
    def key_id(self) -> str:
        raw = self.public_key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return blake3(raw).hexdigest()[:16]

    def public_pem(self) -> bytes:
        """The public key as PEM (``SubjectPublicKeyInfo``): what other nodes trust."""
        return self.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign(self, message: bytes) -> bytes:
        if self.private_key is None:
            raise FailedPrecondition(
                "signing needs the private key; the key file holds only a public key"
            )
        return self.private_key.sign(message)

    def check(self, message: bytes, signature: bytes) -> bool:
        try:
            self.public_key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


def load_signing_key(path: Path, *, public_only: bool = False) -> SigningKey:
    """Read a PEM Ed25519 private key, or a PEM public key (verify-only).

    ``public_only``: the file is a trusted public key (checked as one, ``load_public_key``).
    """
    data, st = _read_key_file(path, "signing key")
    if b"PRIVATE KEY" in data and not public_only:
        check_secret_file(path, st, "signing key")
    else:
        check_public_file(path, st, "trusted key" if public_only else "signing key")
    if b"ENCRYPTED PRIVATE KEY" in data or b"Proc-Type: 4,ENCRYPTED" in data:
        raise InvalidArgument(
            f"signing key file {path} is passphrase-protected, which is not supported; "
            "use an unencrypted key file readable only by its owner (mode 0600)"
        )
    if b"PRIVATE KEY" in data and public_only:
        raise InvalidArgument(
            f"trusted key file {path} holds a private key; trust its public half "
            f"(`gpusnap store pubkey {path}`), never copy a private key to other nodes"
        )
    if b"PRIVATE KEY" in data:
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"signing key file {path} is not a readable PEM key") from exc
        if not isinstance(private, Ed25519PrivateKey):
            raise InvalidArgument(f"signing key file {path} is not an Ed25519 key")
        return SigningKey(private.public_key(), private)
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"signing key file {path} is not a readable PEM key") from exc
    if not isinstance(public, Ed25519PublicKey):
        raise InvalidArgument(f"signing key file {path} is not an Ed25519 key")
    return SigningKey(public, None)


# The names ``load_trusted_keys`` takes from a directory of public keys.
PUBLIC_KEY_SUFFIX = ".pub"


def load_public_key(path: Path) -> SigningKey:
    """A PEM Ed25519 public key file; a private key is refused (it would spread a secret)."""
    key = load_signing_key(path, public_only=True)
    return SigningKey(key.public_key, None, load_scope(path))


def load_trusted_keys(paths: Iterable[Path]) -> tuple[SigningKey, ...]:
    """The public keys named by ``paths``: each a key file, or a directory whose ``*.pub``
    files are read (other names are left alone). Duplicates count once."""
    found: dict[str, SigningKey] = {}
    for path in paths:
        if path.is_dir():
            try:
                check_trusted_path(f"trusted keys directory {path}", os.stat(path))
                names = sorted(os.listdir(path))
            except OSError as exc:
                raise InvalidArgument(f"cannot list trusted keys {path}: {exc.strerror}") from exc
            files = [path / n for n in names if n.endswith(PUBLIC_KEY_SUFFIX)]
        else:
            files = [path]
        for file in files:
            key = load_public_key(file)
            found.setdefault(key.key_id, key)
    return tuple(found.values())


class UntrustedSigner(Corrupt):
    """An envelope is signed by a key this node does not trust (revoked, or a stranger's)."""

    def __init__(self, message: str, key_id: str | None = None) -> None:
        super().__init__(message)
        self.key_id = key_id


class EncryptionKeys:
    """The keys derived from one encryption key file."""

    def __init__(self, master: bytes) -> None:
        if len(master) != ENCRYPTION_KEY_BYTES:
            raise InvalidArgument(f"an encryption key is {ENCRYPTION_KEY_BYTES} bytes")
        self.chunk_id_key = _derive(master, _CTX_CHUNK_ID)
        self.chunk_aead = AESGCM(_derive(master, _CTX_CHUNK_DATA))
        self.record_aead = AESGCM(_derive(master, _CTX_RECORD_DATA))
        self.key_id = blake3(_derive(master, "gpusnap 2026-11 key id")).hexdigest()[:16]


def _derive(master: bytes, context: str) -> bytes:
    return bytes(blake3(master, derive_key_context=context).digest())


def load_encryption_key(path: Path) -> EncryptionKeys:
    data, st = _read_key_file(path, "encryption key")
    check_secret_file(path, st, "encryption key")
    if len(data) != ENCRYPTION_KEY_BYTES:
        raise InvalidArgument(
            f"encryption key file {path} must hold exactly {ENCRYPTION_KEY_BYTES} bytes"
        )
    return EncryptionKeys(data)


# --- signed (and optionally encrypted) records ------------------------------------------------


def seal(
    kind: str,
    payload: bytes,
    *,
    signer: SigningKey | None,
    encryption: EncryptionKeys | None,
) -> bytes:
    """Wrap ``payload`` in a JSON envelope: encrypted when a key is given, then signed.

    The signature covers the format name, the encryption marker and the stored payload, so
    an envelope of one kind can never pass as another, and nothing in it can be swapped.
    """
    body = payload
    enc = "none"
    if encryption is not None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        enc = "aes-256-gcm"
        body = nonce + encryption.record_aead.encrypt(nonce, payload, kind.encode())
    envelope: dict[str, Any] = {"format": kind, "encryption": enc}
    envelope["payload"] = base64.b64encode(body).decode()
    if signer is not None:
        envelope["signature"] = base64.b64encode(signer.sign(_signed_message(kind, enc, body)))
        envelope["signature"] = envelope["signature"].decode()
        envelope["key_id"] = signer.key_id
    else:
        envelope["signature"] = None
        envelope["key_id"] = None
    return json.dumps(envelope, sort_keys=True).encode()


def _signed_message(kind: str, enc: str, body: bytes) -> bytes:
    return kind.encode() + b"\0" + enc.encode() + b"\0" + body


def unseal(
    blob: bytes,
    kind: str,
    *,
    signer: SigningKey | None,
    encryption: EncryptionKeys | None,
    verify: bool,
    what: str,
    trusted: Mapping[str, SigningKey] | None = None,
) -> bytes:
    """Check and open an envelope made by ``seal``; ``Corrupt`` naming ``what`` if it is bad.

    The signature must be by ``signer`` or one of ``trusted`` (by key id); any other signer
    is ``UntrustedSigner`` naming its key id.
    """
    envelope = load_json(blob, what, envelope=kind)
    if not isinstance(envelope, dict) or envelope.get("format") != kind:
        raise Corrupt(f"{what} is not a {kind} envelope")
    enc = envelope.get("encryption")
    signature_b64 = envelope.get("signature")
    key_id = envelope.get("key_id")
    if not (
        isinstance(enc, str)
        and isinstance(envelope.get("payload"), str)
        and isinstance(signature_b64, str | None)
        and isinstance(key_id, str | None)
    ):
        raise Corrupt(f"{what} is not a readable {kind} envelope")
    try:
        body = base64.b64decode(envelope["payload"], validate=True)
    except ValueError as exc:  # binascii.Error, and non-ASCII text
        raise Corrupt(f"{what} is not a readable {kind} envelope") from exc
    if verify:
        accepted = dict(trusted or {})
        if signer is not None:
            accepted[signer.key_id] = signer
        if not accepted:
            raise FailedPrecondition(
                f"cannot verify {what}: no signing key file given (or turn verification off)"
            )
        if not signature_b64:
            raise Corrupt(f"{what} is not signed")
        checker = accepted.get(str(key_id))
        if checker is None:
            raise UntrustedSigner(
                f"{what} is signed by key {printable(key_id)}, which this node does not trust "
                f"(trusted: {', '.join(accepted)}; add the signer's public key to the "
                "trusted keys to accept it)",
                printable(key_id),
            )
        try:
            signature = base64.b64decode(signature_b64, validate=True)
        except ValueError as exc:
            raise Corrupt(f"{what} has an unreadable signature") from exc
        if not checker.check(_signed_message(kind, str(enc), body), signature):
            raise Corrupt(f"{what} failed its signature check (altered or forged)")
    if enc == "none":
        return body
    if enc != "aes-256-gcm":
        raise Corrupt(f"{what} uses an unknown encryption {printable(enc)!r}")
    if encryption is None:
        raise FailedPrecondition(f"{what} is encrypted; an encryption key file is needed")
    try:
        return encryption.record_aead.decrypt(body[:NONCE_BYTES], body[NONCE_BYTES:], kind.encode())
    except (InvalidTag, ValueError) as exc:
        raise Corrupt(f"{what} does not decrypt with this encryption key") from exc


@dataclass(frozen=True)
class StoreKeys:
    """The keys one store is opened with, and whether it verifies what it reads.

    Everything the store signs (manifests, records, the store's config) is sealed and opened
    here, so that the question "whose signature does this node accept" has one answer: its
    own key (``signer``) and the public keys in ``trusted``.
    """

    signer: SigningKey | None
    encryption: EncryptionKeys | None
    verify: bool = True
    trusted: tuple[SigningKey, ...] = ()

    @property
    def trusted_ids(self) -> list[str]:
        """The key ids whose signatures this node accepts, its own first."""
        own = [self.signer.key_id] if self.signer is not None else []
        return own + [k.key_id for k in self.trusted if k.key_id not in own]

    def seal(self, kind: str, payload: bytes) -> bytes:
        """``payload`` in an envelope of format ``kind``: encrypted when a key is given, signed."""
        return seal(kind, payload, signer=self.signer, encryption=self.encryption)

    def unseal(self, blob: bytes, kind: str, *, what: str, verify: bool | None = None) -> bytes:
        """The payload of an envelope made by ``seal``; ``Corrupt`` naming ``what`` if bad.

        ``verify`` (default: the store's setting) checks the signature.
        """
        return unseal(
            blob,
            kind,
            signer=self.signer,
            encryption=self.encryption,
            verify=self.verify if verify is None else verify,
            what=what,
            trusted={k.key_id: k for k in self.trusted},
        )

    def check_scope(self, blob: bytes, workload: str, node: str | None, what: str) -> None:
        """Refuse (``UntrustedSigner``) ``blob``, already unsealed, if its signer is a trusted
        key whose scope does not cover ``workload`` (and ``node``)."""
        if not self.verify or all(k.scope is None for k in self.trusted):
            return
        key_id = envelope_key_id(blob)
        if self.signer is not None and key_id == self.signer.key_id:
            return
        scoped = next((k for k in self.trusted if k.key_id == key_id), None)
        why = (
            None if scoped is None or scoped.scope is None else scoped.scope.refusal(workload, node)
        )
        if why is not None:
            raise UntrustedSigner(f"{what} is signed by key {key_id}, but {why}", key_id)

    def check_can_push(self) -> None:
        """Refuse, before any upload, a push whose manifest could not be signed."""
        if self.signer is None and self.verify:
            raise FailedPrecondition("pushing needs a signing key file (or verification off)")
        if self.signer is not None and self.signer.private_key is None:
            raise FailedPrecondition("signing needs the private key; this key file is public only")
