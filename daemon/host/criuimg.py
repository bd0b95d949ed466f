"""CRIU's image files, read without a protobuf schema.

A CRIU image (criu/include/magic.h, criu/protobuf.c) is a little-endian u32 magic — the common
``IMG_COMMON_MAGIC`` or the service ``IMG_SERVICE_MAGIC`` — then the image's own u32 magic, then
its entries, each a u32 length and that many bytes of one protobuf message. gpusnap reads only a
few fields of a few images (the dump's statistics, the regular files the tasks held open, the
mounts), by their field numbers in criu/images/*.proto: varints and length-delimited fields.
"""

from __future__ import annotations

import struct

COMMON_MAGIC = 0x54564319  # IMG_COMMON_MAGIC, "Sarov"
SERVICE_MAGIC = 0x55105940  # IMG_SERVICE_MAGIC, "Zlatoust"


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def zigzag(value: int) -> int:
    """A ``sint32``/``sint64`` field's value from its varint."""
    return (value >> 1) ^ -(value & 1)


def fields(buf: bytes) -> dict[int, int | bytes]:
    """Top-level fields of one protobuf message: varints as ints, length-delimited as bytes (the
    last one of a repeated field)."""
    out: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            out[number], pos = varint(buf, pos)
        elif wire == 2:
            n, pos = varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("truncated field")
            out[number] = buf[pos : pos + n]
            pos += n
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unknown wire type {wire}")
    return out


def entries(data: bytes, magic: int) -> list[bytes]:
    """The entries of an image whose own magic is ``magic``; ``ValueError`` when ``data`` is not
    one or is cut short."""
    pos = 0
    first = _u32(data, pos)
    if first in (COMMON_MAGIC, SERVICE_MAGIC):
        pos += 4
        first = _u32(data, pos)
    if first != magic:
        raise ValueError(f"magic {first:#x}, not {magic:#x}")
    pos += 4
    out: list[bytes] = []
    while pos < len(data):
        size = _u32(data, pos)
        pos += 4
        if pos + size > len(data):
            raise ValueError("truncated entry")
        out.append(data[pos : pos + size])
        pos += size
    return out


def _u32(data: bytes, pos: int) -> int:
    try:
        (value,) = struct.unpack_from("<I", data, pos)
        return int(value)
    except struct.error as exc:
        raise ValueError("truncated image") from exc
