"""A model's ``config.json``, read field by field, and the shapes of the layers it describes.

The field names and their fallbacks are the serving engines' (vLLM ``ModelConfig``,
SGLang ``ModelConfig``), so a figure here is the figure the engine allocates for. A field
that is missing or of the wrong type is an error that names it: nothing is guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpusnap.errors import InvalidArgument, NotFound, Unsupported

# Bytes per element of the dtypes a config names (``torch_dtype`` / ``dtype``).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "fp8": 1,
}


class Kind(StrEnum):
    """The kinds of layer whose state a serving engine keeps per session."""

    FULL = "full_attention"  # K and V of every token (MHA, GQA, MQA)
    SLIDING = "sliding_window"  # K and V of the last ``window`` tokens
    MLA = "latent_attention"  # one compressed latent per token (DeepSeek MLA)
    COMPRESSED = "compressed_attention"  # window + one entry per ``stride`` tokens
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GATED_DELTANET = "gated_deltanet"
    KDA = "kda"


ATTENTION_KINDS = (Kind.FULL, Kind.SLIDING, Kind.MLA, Kind.COMPRESSED)


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's cache entry: ``kv_heads x (head_dim + head_dim_v)`` elements.

    A latent layer (MLA, compressed) stores one vector per entry (``head_dim_v`` 0) that every
    tensor-parallel rank holds whole (``split_by_tp`` False).
    """

    kind: Kind
    kv_heads: int
    head_dim: int
    head_dim_v: int
    split_by_tp: bool = True
    window: int | None = None  # SLIDING and COMPRESSED: tokens kept uncompressed
    stride: int = 0  # COMPRESSED: one extra entry per ``stride`` tokens (0: window only)


@dataclass(frozen=True)
class StateShape:
    """One state-space or linear-attention layer: a convolution state and a recurrent state.

    ``conv_channels x conv_len`` and ``rec_heads x rec_inner`` elements in all; tensor
    parallelism divides ``conv_channels`` and ``rec_heads``. Mamba2 replicates its B/C groups
    when tp does not divide ``n_groups`` (vLLM ``extra_groups_for_head_shards``), hence the
    group fields.
    """

    kind: Kind
    conv_channels: int
    conv_len: int
    rec_heads: int
    rec_inner: int
    rec_fp32: bool = False  # KDA: vLLM keeps the recurrent state in float32 whatever the model
    n_groups: int = 0  # MAMBA2 only
    d_state: int = 0  # MAMBA2 only
    d_inner: int = 0  # MAMBA2 only


LayerShape = AttentionShape | StateShape


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its layers in order and a few sizes."""

    model_type: str
    architectures: tuple[str, ...]
    dtype: str
    dtype_bytes: int
    layers: tuple[LayerShape | None, ...]  # None: a layer with no per-session state (MLP-only)
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None
    ssm_dtype_bytes: int | None = None  # the state dtype the config itself names, if any
    notes: tuple[str, ...] = field(default_factory=tuple)

    def count(self, kind: Kind) -> int:
        return sum(1 for layer in self.layers if layer is not None and layer.kind == kind)

    def kinds(self) -> list[Kind]:
        return [k for k in Kind if self.count(k)]


class Fields:
    """A config dict (the text model's, with ``text_config`` unnested) read with field names.

    ``missing`` collects the names of required fields that are absent, so one error can name
    them all (``raise_missing``).
    """

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where
        self.missing: list[str] = []

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def opt_int(self, *names: str) -> int | None:
        """The first of ``names`` that is set, as a positive integer."""
        for name in names:
            value = self.data.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(
                    f"{self.where}: {name} must be a non-negative integer, not {value!r}"
                )
            return value
        return None

    def req_int(self, *names: str) -> int:
        """The first of ``names`` that is set; records ``names[0]`` as missing if none is."""
        value = self.opt_int(*names)
        if value is None:
            self.missing.append(" or ".join(names))
            return 0
        return value

    def opt_bool(self, name: str) -> bool | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise InvalidArgument(f"{self.where}: {name} must be true or false, not {value!r}")
        return value

    def int_list(self, name: str) -> list[int] | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise InvalidArgument(f"{self.where}: {name} must be a list of non-negative integers")
        return list(value)

    def str_list(self, name: str) -> list[str] | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidArgument(f"{self.where}: {name} must be a list of strings")
        return list(value)

    def sub(self, name: str) -> Fields | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidArgument(f"{self.where}: {name} must be an object")
        return Fields(value, f"{self.where}: {name}")

    def raise_missing(self, what: str) -> None:
        if self.missing:
            names = ", ".join(dict.fromkeys(self.missing))
            self.missing = []
            raise Unsupported(f"{self.where}: cannot size {what}: the config lacks {names}")


def find_config(model: Path) -> Path:
    """``--model`` names a directory holding ``config.json``, or the file itself."""
    path = model / "config.json" if model.is_dir() else model
    if not path.exists():
        raise NotFound(f"no model config at {path}")
    if not path.is_file():
        raise InvalidArgument(f"{path} is not a file")
    return path


def load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror or exc}") from exc
    return parse_json_object(raw, path, what)


def parse_json_object(raw: bytes, path: Path, what: str) -> dict[str, Any]:
    """``raw`` as a JSON object, or ``InvalidArgument`` naming ``path`` and ``what`` it is."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{path} is not valid JSON ({what}): {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path} is not a JSON object ({what})")
    return data


def text_fields(config: dict[str, Any], where: str) -> tuple[Fields, Fields]:
    """The top-level fields and the text model's (``text_config`` when the config nests one,
    as multimodal configs do: vLLM ``get_text_config``). Fields the text config lacks but the
    top level has (``torch_dtype`` in Gemma 3) are taken from the top level."""
    top = Fields(config, where)
    nested = top.sub("text_config")
    if nested is None:
        return top, top
    merged = {k: v for k, v in config.items() if k != "text_config"}
    merged.update(nested.data)
    return top, Fields(merged, f"{where}: text_config")


def dtype_of(fields: Fields, top: Fields) -> tuple[str, int]:
    """The model dtype (``torch_dtype``, or ``dtype`` in newer configs); bfloat16 if unset,
    as transformers' loaders and vLLM's ``dtype=auto`` treat an unset one for bf16 models."""
    for source in (fields, top):
        for name in ("torch_dtype", "dtype"):
            value = source.raw(name)
            if isinstance(value, str):
                key = value.removeprefix("torch.")
                if key not in DTYPE_BYTES:
                    raise Unsupported(f"{source.where}: unknown {name} {value!r}")
                return key, DTYPE_BYTES[key]
    return "bfloat16", 2
