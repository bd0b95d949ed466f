"""Chunk naming and the chunk object format: header, optional zstd, optional AES-256-GCM.

A chunk object is::

    magic "GSNC" | version u8 (=1) | flags u8 | reserved u16 (=0) | raw length u64 LE   (16 bytes)
    [nonce, 12 bytes]                                     when flags has ENCRYPTED
    body: zstd frame (COMPRESSED) or the raw bytes; with ENCRYPTED, AES-256-GCM of that
          with the 16-byte header and the chunk id as associated data (tag at the end)

A chunk's id is the BLAKE3-256 of its uncompressed content, hex; with an encryption key the
hash is keyed (key derived from the encryption key) so that names reveal nothing about the
content. Every decode re-hashes the content and refuses a mismatch.

python-zstandard (de)compressors are not thread-safe: each thread gets its own.
"""

from __future__ import annotations

import secrets
import struct
import threading
from dataclasses import dataclass

import zstandard
from blake3 import blake3
from cryptography.exceptions import InvalidTag

from gpusnap.errors import Corrupt, FailedPrecondition
from gpusnap.storage.chunker import MAX_SIZE
from gpusnap.storage.keys import NONCE_BYTES, EncryptionKeys

MAGIC = b"GSNC"
VERSION = 1
FLAG_COMPRESSED = 0x01
FLAG_ENCRYPTED = 0x02
_KNOWN_FLAGS = FLAG_COMPRESSED | FLAG_ENCRYPTED
_HEADER = struct.Struct("<4sBBHQ")
HEADER_SIZE = _HEADER.size
ZSTD_LEVEL = 1
# Compression must save at least this fraction of the bytes, or the chunk is stored raw:
# decompressing a frame that saves almost nothing costs restore time for no wire time.
MIN_SAVING = 0.03
# No chunk is larger than the chunker's maximum; a size above it is refused unread.
MAX_CHUNK_BYTES = MAX_SIZE
_GCM_TAG_BYTES = 16
# The largest chunk object there can be: a header, a nonce, the content (a compressed body is
# kept only when smaller) and the cipher's tag. A larger object is refused unread.
MAX_OBJECT_BYTES = HEADER_SIZE + NONCE_BYTES + MAX_CHUNK_BYTES + _GCM_TAG_BYTES


@dataclass(frozen=True)
class EncodedChunk:
    data: bytes
    compressed: bool


class ChunkCodec:
    """Names, encodes and decodes chunks for one store configuration."""

    def __init__(self, encryption: EncryptionKeys | None) -> None:
        self._encryption = encryption
        self._local = threading.local()

    @property
    def encrypted(self) -> bool:
        return self._encryption is not None

    def chunk_id(self, data: memoryview | bytes) -> str:
        if self._encryption is not None:
            return str(blake3(data, key=self._encryption.chunk_id_key).hexdigest())
        return str(blake3(data).hexdigest())

    def _compressor(self) -> zstandard.ZstdCompressor:
        comp: zstandard.ZstdCompressor | None = getattr(self._local, "compressor", None)
        if comp is None:
            comp = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
            self._local.compressor = comp
        return comp

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dec: zstandard.ZstdDecompressor | None = getattr(self._local, "decompressor", None)
        if dec is None:
            dec = zstandard.ZstdDecompressor()
            self._local.decompressor = dec
        return dec

    def encode(self, chunk_id: str, data: memoryview | bytes, *, compress: bool) -> EncodedChunk:
        """The object bytes for one chunk."""
        raw_len = len(data)
        flags = 0
        body: bytes | memoryview = data
        if compress and raw_len > 0:
            packed = self._compressor().compress(data)
            if len(packed) <= raw_len * (1.0 - MIN_SAVING):
                body = packed
                flags |= FLAG_COMPRESSED
        if self._encryption is not None:
            flags |= FLAG_ENCRYPTED
            header = _HEADER.pack(MAGIC, VERSION, flags, 0, raw_len)
            nonce = secrets.token_bytes(NONCE_BYTES)
            sealed = self._encryption.chunk_aead.encrypt(nonce, body, _aad(header, chunk_id))
            return EncodedChunk(b"".join((header, nonce, sealed)), bool(flags & FLAG_COMPRESSED))
        header = _HEADER.pack(MAGIC, VERSION, flags, 0, raw_len)
        return EncodedChunk(b"".join((header, body)), bool(flags & FLAG_COMPRESSED))

    def decode(self, chunk_id: str, obj: bytes, size: int) -> bytes | memoryview:
        """The verified content of a chunk object; ``Corrupt`` naming the chunk otherwise.

        ``size`` is the chunk's size as the (authenticated) manifest declares it. The object's
        header is not authenticated (without encryption), so it is checked against ``size``
        and ``MAX_CHUNK_BYTES`` before anything is allocated or decompressed: a planted object
        cannot make a reader allocate more than the manifest promised. A raw chunk comes back
        as a view into ``obj`` (no copy).
        """
        compressed, body = self._open(chunk_id, obj, size)
        content: bytes | memoryview = body
        if compressed:
            content = self._decompress(chunk_id, body, size)
        if len(content) != size:
            raise Corrupt(f"chunk {chunk_id} has {len(content)} bytes, header says {size}")
        if self.chunk_id(content) != chunk_id:
            raise Corrupt(f"chunk {chunk_id} does not match its hash")
        return content

    def decode_into(self, chunk_id: str, obj: bytes, out: memoryview) -> None:
        """Like ``decode``, into ``out`` (exactly the chunk's size): no buffer is allocated.

        The pull path decompresses into reused, page-aligned buffers, which it can hand to
        ``O_DIRECT`` writes; ``out`` holds verified content only when this returns.
        """
        size = len(out)
        compressed, body = self._open(chunk_id, obj, size)
        if not compressed:
            if len(body) != size:
                raise Corrupt(f"chunk {chunk_id} has {len(body)} bytes, header says {size}")
            out[:] = body
        else:
            self._check_frame(chunk_id, body, size)
            try:
                reader = self._decompressor().stream_reader(body, read_size=len(body))
                done = 0
                while done < size:
                    n = reader.readinto(out[done:])
                    if n <= 0:
                        break
                    done += n
                extra = reader.read(1)  # more content than declared (within this frame)
            except (zstandard.ZstdError, MemoryError, ValueError) as exc:
                raise Corrupt(f"chunk {chunk_id} does not decompress") from exc
            if done != size or extra:
                raise Corrupt(f"chunk {chunk_id} does not decompress to {size} bytes")
        if self.chunk_id(out) != chunk_id:
            raise Corrupt(f"chunk {chunk_id} does not match its hash")

    def _open(self, chunk_id: str, obj: bytes, size: int) -> tuple[bool, bytes | memoryview]:
        """Check a chunk object's header against ``size``; (compressed?, plain body)."""
        if size < 0 or size > MAX_CHUNK_BYTES:
            raise Corrupt(
                f"chunk {chunk_id} is declared with {size} bytes, more than any chunk "
                f"({MAX_CHUNK_BYTES})"
            )
        if len(obj) < HEADER_SIZE:
            raise Corrupt(f"chunk {chunk_id} is truncated ({len(obj)} bytes)")
        magic, version, flags, _reserved, raw_len = _HEADER.unpack_from(obj)
        if magic != MAGIC or version != VERSION or flags & ~_KNOWN_FLAGS:
            raise Corrupt(f"chunk {chunk_id} has an unknown header")
        if raw_len != size:
            raise Corrupt(
                f"chunk {chunk_id}: its header says {raw_len} bytes, the manifest says {size}"
            )
        view = memoryview(obj)[HEADER_SIZE:]
        body: bytes | memoryview = view
        if flags & FLAG_ENCRYPTED:
            if self._encryption is None:
                raise FailedPrecondition(
                    f"chunk {chunk_id} is encrypted; an encryption key file is needed"
                )
            try:
                body = self._encryption.chunk_aead.decrypt(
                    bytes(view[:NONCE_BYTES]), view[NONCE_BYTES:], _aad(obj[:HEADER_SIZE], chunk_id)
                )
            except (InvalidTag, ValueError) as exc:
                raise Corrupt(f"chunk {chunk_id} failed authentication (altered?)") from exc
        return bool(flags & FLAG_COMPRESSED), body

    def _check_frame(self, chunk_id: str, body: bytes | memoryview, raw_len: int) -> None:
        # A frame that records its content size is decompressed into a buffer of that size
        # whatever ``max_output_size`` says: check the size before zstd allocates it.
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise Corrupt(f"chunk {chunk_id} does not decompress") from exc
        if declared not in (-1, raw_len):
            raise Corrupt(
                f"chunk {chunk_id}: its zstd frame says {declared} bytes, "
                f"the manifest says {raw_len}"
            )

    def _decompress(self, chunk_id: str, body: bytes | memoryview, raw_len: int) -> bytes:
        self._check_frame(chunk_id, body, raw_len)
        try:
            out: bytes = self._decompressor().decompress(body, max_output_size=raw_len)
        except (zstandard.ZstdError, MemoryError) as exc:
            raise Corrupt(f"chunk {chunk_id} does not decompress") from exc
        return out


def _aad(header: bytes, chunk_id: str) -> bytes:
    return header + chunk_id.encode()
