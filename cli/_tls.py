"""The CLI's side of gpusnapd's mutual-TLS listener: ``--address`` and the client's files.

Everything here is checked before a connection is tried, so a mistake on this machine (a
missing or unreadable file, a key that is not the certificate's, ``host`` without a port) is a
usage error (exit 2) naming the option and the file, never a vague handshake failure. There is
no plaintext TCP: an address always comes with a CA, a client certificate and its key.

Imports no gRPC; ``cli/_client.py`` turns a ``ClientTls`` into channel credentials.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes

from gpusnap.errors import InvalidArgument

# Far above any certificate chain; keeps `--tls-ca /dev/zero` from reading forever.
MAX_PEM_BYTES = 1024 * 1024

_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252}[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")
# gRPC's "failed to connect" details: the reason is what follows the last address prefix.
_GRPC_CONNECT_PREFIX = re.compile(
    r"^failed to connect to all addresses; last error: (?:[A-Z_]+: )?(?:ipv4|ipv6|dns):\S+: "
)
# Why a handshake failed, in the operator's terms; the first match adds its hint.
_HANDSHAKE_HINTS = (
    ("CERTIFICATE_VERIFY_FAILED", "is the daemon's certificate signed by the CA in --tls-ca?"),
    (
        "Hostname Verification",
        "the daemon's certificate does not name this host; --tls-server-name sets the name",
    ),
    ("WRONG_VERSION_NUMBER", "does this port speak TLS?"),
    (
        "Socket closed",
        "the daemon ended the TLS handshake: is --tls-cert signed by its client_ca_file?",
    ),
)


@dataclass(frozen=True)
class ClientTls:
    """What the client presents and trusts, as PEM bytes, all read and checked."""

    ca: bytes  # the CA that signs the daemon's certificate
    cert: bytes  # the client certificate (chain), signed by the daemon's client_ca_file
    key: bytes  # its private key, unencrypted
    server_name: str | None = None  # the name to verify instead of the address's host


def parse_address(text: str, *, source: str = "--address") -> str:
    """``host:port``, ``1.2.3.4:port`` or ``[v6]:port``, checked; ``InvalidArgument`` else."""
    host, sep, port = text.rpartition(":")
    valid = bool(sep) and _PORT.fullmatch(port) is not None and 0 < int(port) < 65536
    if valid and host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            valid = False
    elif valid:
        valid = _HOST_NAME.fullmatch(host) is not None
    if not valid:
        raise InvalidArgument(
            f"{source} must be HOST:PORT (e.g. gpu-node-17:7443, 10.0.0.5:7443 or "
            f"[fd00::5]:7443), not {text!r}"
        )
    return text


def _read_pem(path: Path, source: str) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise InvalidArgument(f"cannot read {source} file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PEM_BYTES:
        raise InvalidArgument(f"{source} file {path} is over {MAX_PEM_BYTES} bytes: not a PEM file")
    return data


def _certificates(data: bytes, path: Path, source: str) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise InvalidArgument(
            f"{source} file {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ) from None


def _spki(public: PublicKeyTypes) -> bytes:
    return public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_client_tls(
    *,
    ca: tuple[Path, str],
    cert: tuple[Path, str],
    key: tuple[Path, str],
    server_name: str | None = None,
) -> ClientTls:
    """Read and check the three files; each is ``(path, the option or variable that named
    it)`` so an error names both. ``InvalidArgument`` (exit 2) for any problem."""
    if server_name is not None and not server_name:
        raise InvalidArgument("--tls-server-name must not be empty")
    ca_pem = _read_pem(*ca)
    cert_pem = _read_pem(*cert)
    key_pem = _read_pem(*key)
    _certificates(ca_pem, *ca)
    leaf = _certificates(cert_pem, *cert)[0]
    key_path, key_source = key
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise InvalidArgument(
            f"{key_source} file {key_path} is encrypted; gRPC needs an unencrypted key "
            "(protect it with file permissions)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise InvalidArgument(
            f"{key_source} file {key_path} holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
        ) from None
    if _spki(private.public_key()) != _spki(leaf.public_key()):
        raise InvalidArgument(
            f"{key_source} file {key_path} is not the key of the certificate in {cert[1]} "
            f"file {cert[0]}"
        )
    return ClientTls(ca=ca_pem, cert=cert_pem, key=key_pem, server_name=server_name)


def explain_unreachable(details: str) -> str:
    """gRPC's one-line reason a TLS connection failed, shortened, with a hint when known."""
    why = _GRPC_CONNECT_PREFIX.sub("", " ".join(details.split())).removesuffix(": OK")
    for marker, hint in _HANDSHAKE_HINTS:
        if marker in why:
            return f"{why} ({hint})"
    return why
