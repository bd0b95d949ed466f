"""The model's weight bytes, exactly, from its safetensors files' own metadata.

``model.safetensors.index.json`` carries ``metadata.total_size``, the byte count of every
tensor of a sharded checkpoint. A single-file checkpoint (``model.safetensors``) has no index:
its header (an 8-byte little-endian length, then JSON with each tensor's ``data_offsets``)
gives the same figure without reading the tensors.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gpusnap.cli.plan.shapes import load_json, parse_json_object
from gpusnap.errors import InvalidArgument, NotFound

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit on the JSON header


@dataclass(frozen=True)
class Weights:
    total_bytes: int
    source: str  # the file the figure was read from


def from_index(path: Path) -> Weights:
    """``metadata.total_size`` of a safetensors index."""
    if not path.exists():
        raise NotFound(f"no safetensors index at {path}")
    data = load_json(path, "safetensors index")
    metadata = data.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if isinstance(total, float) and total.is_integer():
        total = int(total)  # some exporters write the count as a float
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise InvalidArgument(f"{path}: metadata.total_size is missing or not a positive integer")
    return Weights(total, str(path))


def from_single_file(path: Path) -> Weights:
    """The tensor bytes of one ``.safetensors`` file, from its header alone."""
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise InvalidArgument(f"{path}: too short for a safetensors header")
            (length,) = struct.unpack("<Q", raw_len)
            if length > _MAX_HEADER:
                raise InvalidArgument(f"{path}: safetensors header of {length} bytes is too long")
            raw = f.read(length)
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror or exc}") from exc
    header = parse_json_object(raw, path, "safetensors header")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise InvalidArgument(f"{path}: tensor {name!r} has no data_offsets")
        end = max(end, int(offsets[1]))
    return Weights(end, str(path))


def find(model: Path, index: Path | None) -> Weights | None:
    """The weights named by ``--safetensors-index``, else those beside the model's config."""
    if index is not None:
        return from_index(index)
    directory = model if model.is_dir() else model.parent
    if (directory / INDEX_NAME).is_file():
        return from_index(directory / INDEX_NAME)
    if (directory / SINGLE_NAME).is_file():
        return from_single_file(directory / SINGLE_NAME)
    return None
