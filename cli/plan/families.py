"""Which layer of a model is which kind, from the fields each family's config uses.

One function per family, tried in order from the most specific marker to plain attention;
each reads the fields the engines read for that family (see the comments for the engine code
each follows). A config whose layout none of them recognises, or that lacks a field its
family needs, is an error that names the fields: never a guess.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpusnap.cli.plan.shapes import (
    DTYPE_BYTES,
    AttentionShape,
    Fields,
    Kind,
    LayerShape,
    ModelShape,
    StateShape,
    dtype_of,
    find_config,
    load_json,
    text_fields,
)
from gpusnap.errors import InvalidArgument, Unsupported

# Interleaving defaults of the transformers config classes, for configs that leave the field
# out (Gemma 2 alternates; Gemma 3 has five local layers per global one; Cohere2 three).
_DEFAULT_WINDOW_PATTERN = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6, "cohere2": 4}

# Layouts we recognise but do not size: refusing beats a figure that is silently wrong.
_UNSUPPORTED_MARKERS = {
    "attention_chunk_size": "chunked local attention (Llama 4)",
    "layers_block_type": "a per-layer block-type list (layers_block_type)",
    "attn_type_list": "a per-layer attention-type list (attn_type_list)",
}

Layout = list[LayerShape | None]


def read_model(model: Path) -> ModelShape:
    """Read ``config.json`` (or ``DIR/config.json``) into the shapes of its layers."""
    path = find_config(model)
    config = load_json(path, "model config")
    return shape_from_config(config, str(path))


def shape_from_config(config: dict[str, object], where: str = "config.json") -> ModelShape:
    top, f = text_fields(dict(config), where)
    n_layers = f.req_int("num_hidden_layers", "n_layer", "num_layers")
    f.raise_missing("the model")
    if n_layers == 0:
        raise InvalidArgument(f"{f.where}: num_hidden_layers is 0")
    dtype, dtype_bytes = dtype_of(f, top)
    layout: Layout | None = None
    for family in _FAMILIES:
        layout = family(f, n_layers)
        if layout is not None:
            break
    assert layout is not None  # _plain_attention always answers or raises
    if len(layout) != n_layers:
        raise InvalidArgument(
            f"{f.where}: the layer layout lists {len(layout)} layers, "
            f"num_hidden_layers is {n_layers}"
        )
    ssm_dtype = f.raw("mamba_ssm_cache_dtype") or f.raw("mamba_ssm_dtype")
    architectures = top.raw("architectures") or f.raw("architectures") or []
    return ModelShape(
        model_type=str(f.raw("model_type") or top.raw("model_type") or "unknown"),
        architectures=tuple(str(a) for a in architectures)
        if isinstance(architectures, list)
        else (),
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        layers=tuple(layout),
        hidden_size=f.opt_int("hidden_size", "d_model", "n_embd") or 0,
        intermediate_size=f.opt_int("intermediate_size", "ffn_hidden_size") or 0,
        vocab_size=f.opt_int("vocab_size") or 0,
        max_position_embeddings=f.opt_int("max_position_embeddings", "model_max_length"),
        ssm_dtype_bytes=DTYPE_BYTES.get(ssm_dtype) if isinstance(ssm_dtype, str) else None,
    )


# -- attention shapes --------------------------------------------------------------------


def _gqa(f: Fields, kind: Kind = Kind.FULL, window: int | None = None) -> AttentionShape:
    """Full or grouped-query attention. Head size: ``head_dim`` first, then
    ``hidden_size_per_head``, then ``hidden_size // num_attention_heads`` (vLLM
    ``ModelConfig.get_head_size``); never derived when ``head_dim`` is given. KV heads:
    ``n_head_kv``, ``num_kv_heads``, ``num_key_value_heads``, ``multi_query_group_num``,
    else every attention head (vLLM ``get_total_num_kv_heads``)."""
    heads = f.req_int("num_attention_heads", "n_head")
    head_dim = f.opt_int("head_dim", "hidden_size_per_head", "attention_head_dim")
    if head_dim is None:
        hidden = f.req_int("hidden_size")
        head_dim = hidden // heads if heads else 0
    kv_heads = (
        f.opt_int("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")
        or heads
    )
    f.raise_missing("the attention layers")
    if head_dim == 0 or kv_heads == 0:
        raise InvalidArgument(f"{f.where}: attention with no heads or a head size of 0")
    return AttentionShape(kind, kv_heads, head_dim, head_dim, window=window)


def _mla(f: Fields) -> AttentionShape:
    """Multi-head latent attention: one ``kv_lora_rank + qk_rope_head_dim`` latent per token
    and layer, held whole by every tensor-parallel rank (vLLM ``MLAAttentionSpec`` with one
    KV head; SGLang ``MLATokenToKVPool``). ``num_key_value_heads`` does not apply."""
    latent = f.req_int("kv_lora_rank") + f.req_int("qk_rope_head_dim")
    f.raise_missing("the latent-attention layers")
    return AttentionShape(Kind.MLA, 1, latent, 0, split_by_tp=False)


def _is_mla(f: Fields) -> bool:
    return f.has("kv_lora_rank") and f.opt_bool("use_mla") is not False


def _window(f: Fields) -> int:
    window = f.req_int("sliding_window")
    f.raise_missing("the sliding-window layers")
    if window == 0:
        raise InvalidArgument(f"{f.where}: sliding_window is 0")
    return window


# -- families, most specific first -------------------------------------------------------


def _refuse_unsupported(f: Fields, n_layers: int) -> Layout | None:
    for name, what in _UNSUPPORTED_MARKERS.items():
        if f.has(name):
            raise Unsupported(f"{f.where}: {what} is not modelled by gpusnap plan ({name})")
    return None


def _kimi_linear(f: Fields, n_layers: int) -> Layout | None:
    """Kimi-Linear: ``linear_attn_config`` lists the 1-based KDA and full-attention layers
    (vLLM ``KimiLinearConfig.is_kda_layer``); full layers are MLA when the config has
    ``kv_lora_rank``. KDA state: conv ``(3·heads·head_dim, kernel-1)``, recurrent
    ``(heads, head_dim, head_dim)`` (vLLM ``MambaStateShapeCalculator.kda_state_shape``)."""
    lin = f.sub("linear_attn_config")
    if lin is None:
        return None
    kda = lin.int_list("kda_layers")
    full = lin.int_list("full_attn_layers")
    heads = lin.req_int("num_heads")
    head_dim = lin.req_int("head_dim")
    kernel = lin.req_int("short_conv_kernel_size")
    if kda is None:
        lin.missing.append("kda_layers")
    if full is None:
        lin.missing.append("full_attn_layers")
    lin.raise_missing("the KDA layers")
    assert kda is not None and full is not None
    state = StateShape(
        Kind.KDA, 3 * heads * head_dim, kernel - 1, heads, head_dim * head_dim, rec_fp32=True
    )
    attention = _mla(f) if _is_mla(f) else _gqa(f)
    layout: Layout = []
    for i in range(1, n_layers + 1):
        if i in kda:
            layout.append(state)
        elif i in full:
            layout.append(attention)
        else:
            raise InvalidArgument(
                f"{lin.where}: layer {i} is in neither kda_layers nor full_attn_layers"
            )
    return layout


def _mamba2(f: Fields) -> StateShape:
    """Mamba2 (Nemotron-H, Zamba2, Falcon-H1's field names): d_inner is
    ``mamba_num_heads·mamba_head_dim`` or ``expand·hidden_size``; conv
    ``(d_inner + 2·n_groups·d_state, d_conv-1)``, recurrent ``(heads, head_dim, d_state)``
    (vLLM ``mamba2_state_shape``)."""
    head_dim = f.req_int("mamba_head_dim", "mamba_d_head")
    heads = f.opt_int("mamba_num_heads", "mamba_n_heads")
    if heads is None:
        expand = f.req_int("expand", "mamba_expand")
        heads = expand * f.req_int("hidden_size") // head_dim if head_dim else 0
    d_state = f.req_int("ssm_state_size", "mamba_d_state")
    n_groups = f.req_int("n_groups", "mamba_n_groups")
    d_conv = f.req_int("conv_kernel", "mamba_d_conv")
    f.raise_missing("the Mamba2 layers")
    d_inner = heads * head_dim
    return StateShape(
        Kind.MAMBA2,
        d_inner + 2 * n_groups * d_state,
        d_conv - 1,
        heads,
        head_dim * d_state,
        n_groups=n_groups,
        d_state=d_state,
        d_inner=d_inner,
    )


def _hybrid_override_pattern(f: Fields, n_layers: int) -> Layout | None:
    """Nemotron-H: one character per layer, ``M`` Mamba2, ``*`` attention, ``-`` MLP and
    ``E`` MoE (no per-session state)."""
    pattern = f.raw("hybrid_override_pattern")
    if pattern is None:
        return None
    if not isinstance(pattern, str) or set(pattern) - set("M*-E"):
        raise InvalidArgument(f"{f.where}: hybrid_override_pattern must use only M, *, - and E")
    state = _mamba2(f) if "M" in pattern else None
    attention = _gqa(f) if "*" in pattern else None
    return [state if c == "M" else attention if c == "*" else None for c in pattern]


def _jamba(f: Fields, n_layers: int) -> Layout | None:
    """Jamba: layer i is attention when ``i % attn_layer_period == attn_layer_offset``, else
    Mamba1 with ``d_inner = mamba_expand·hidden_size``: conv ``(d_inner, d_conv-1)``,
    recurrent ``(d_inner, d_state)`` (vLLM ``mamba1_state_shape``)."""
    if not f.has("attn_layer_period"):
        return None
    period = f.req_int("attn_layer_period")
    offset = f.req_int("attn_layer_offset")
    d_inner = f.req_int("mamba_expand") * f.req_int("hidden_size")
    d_state = f.req_int("mamba_d_state")
    d_conv = f.req_int("mamba_d_conv")
    f.raise_missing("the Jamba layers")
    if period == 0:
        raise InvalidArgument(f"{f.where}: attn_layer_period is 0")
    state = StateShape(Kind.MAMBA1, d_inner, d_conv - 1, d_inner, d_state)
    attention = _gqa(f)
    return [attention if i % period == offset else state for i in range(n_layers)]


def _gated_deltanet(f: Fields) -> StateShape:
    """Qwen3-Next's Gated DeltaNet: conv ``(2·k_heads·k_dim + v_heads·v_dim, kernel-1)``,
    recurrent ``(v_heads, v_dim, k_dim)`` (vLLM ``gated_delta_net_state_shape``)."""
    k_heads = f.req_int("linear_num_key_heads")
    v_heads = f.req_int("linear_num_value_heads")
    k_dim = f.req_int("linear_key_head_dim")
    v_dim = f.req_int("linear_value_head_dim")
    kernel = f.req_int("linear_conv_kernel_dim")
    f.raise_missing("the Gated DeltaNet layers")
    return StateShape(
        Kind.GATED_DELTANET,
        2 * k_heads * k_dim + v_heads * v_dim,
        kernel - 1,
        v_heads,
        v_dim * k_dim,
    )


def _layer_types(f: Fields, n_layers: int) -> Layout | None:
    """``layer_types`` names each layer (Gemma 2/3, gpt-oss, Qwen2/3 and Qwen3-Next in newer
    transformers): ``full_attention``, ``sliding_attention``, ``linear_attention``."""
    types = f.str_list("layer_types")
    if types is None:
        return None
    makers: dict[str, Callable[[], LayerShape]] = {
        "full_attention": lambda: _mla(f) if _is_mla(f) else _gqa(f),
        "attention": lambda: _gqa(f),
        "sliding_attention": lambda: _gqa(f, Kind.SLIDING, _window(f)),
        "linear_attention": lambda: _gated_deltanet(f),
    }
    unknown = sorted(set(types) - set(makers))
    if unknown:
        raise Unsupported(
            f"{f.where}: layer_types names kinds gpusnap plan does not size: {', '.join(unknown)}"
        )
    made = {t: makers[t]() for t in set(types)}
    return [made[t] for t in types]


def _full_attention_interval(f: Fields, n_layers: int) -> Layout | None:
    """Qwen3-Next without ``layer_types``: every ``full_attention_interval``-th layer
    (``(i+1) % interval == 0``) is full attention, the rest Gated DeltaNet."""
    if not f.has("full_attention_interval"):
        return None
    interval = f.req_int("full_attention_interval")
    if interval == 0:
        raise InvalidArgument(f"{f.where}: full_attention_interval is 0")
    attention = _gqa(f)
    state = _gated_deltanet(f)
    return [attention if (i + 1) % interval == 0 else state for i in range(n_layers)]


def _compressed(f: Fields, n_layers: int) -> Layout | None:
    """DeepSeek-V4: ``compress_ratios`` gives each layer's stride (0: window only); a layer
    keeps ``window + ⌈L/stride⌉`` entries of one ``head_dim`` latent, whole on every rank
    (vLLM ``deepseek_v4_attention``, ``MLAAttentionSpec(num_kv_heads=1)``). The list may
    carry multi-token-prediction layers past ``num_hidden_layers``: they are cut off."""
    ratios = f.int_list("compress_ratios")
    if ratios is None:
        return None
    head_dim = f.req_int("head_dim")
    window = _window(f)
    f.raise_missing("the compressed-attention layers")
    if len(ratios) < n_layers:
        raise InvalidArgument(
            f"{f.where}: compress_ratios lists {len(ratios)} layers, "
            f"num_hidden_layers is {n_layers}"
        )
    return [
        AttentionShape(Kind.COMPRESSED, 1, head_dim, 0, split_by_tp=False, window=window, stride=r)
        for r in ratios[:n_layers]
    ]


def _latent(f: Fields, n_layers: int) -> Layout | None:
    if not _is_mla(f):
        return None
    return [_mla(f)] * n_layers


def _window_pattern(f: Fields, n_layers: int) -> Layout | None:
    """Interleaved local/global (Gemma 2/3, Cohere2): layer i is windowed when
    ``(i+1) % sliding_window_pattern != 0``; the pattern defaults to the config class's."""
    model_type = str(f.raw("model_type") or "")
    pattern = f.opt_int("sliding_window_pattern", "_sliding_window_pattern")
    if pattern is None:
        pattern = _DEFAULT_WINDOW_PATTERN.get(model_type)
    if pattern is None or not f.has("sliding_window"):
        return None
    if pattern == 0:
        raise InvalidArgument(f"{f.where}: sliding_window_pattern is 0")
    local = _gqa(f, Kind.SLIDING, _window(f))
    full = _gqa(f)
    return [local if (i + 1) % pattern else full for i in range(n_layers)]


def _qwen_window(f: Fields, n_layers: int) -> Layout | None:
    """Qwen2/Qwen3: windows only with ``use_sliding_window``, on layers
    ``i >= max_window_layers``; without it every layer is full attention."""
    use = f.opt_bool("use_sliding_window")
    if use is None:
        return None
    if not use:
        return [_gqa(f)] * n_layers
    window = _window(f)
    first = f.req_int("max_window_layers")
    f.raise_missing("the sliding-window layers")
    local = _gqa(f, Kind.SLIDING, window)
    full = _gqa(f)
    return [local if i >= first else full for i in range(n_layers)]


def _plain_attention(f: Fields, n_layers: int) -> Layout | None:
    """Every layer the same attention; windowed on all layers when ``sliding_window`` is set
    and nothing above interleaves it (Mistral-7B-v0.1)."""
    if f.has("sliding_window"):
        return [_gqa(f, Kind.SLIDING, _window(f))] * n_layers
    return [_gqa(f)] * n_layers


_FAMILIES: tuple[Callable[[Fields, int], Layout | None], ...] = (
    _refuse_unsupported,
    _kimi_linear,
    _hybrid_override_pattern,
    _jamba,
    _layer_types,
    _full_attention_interval,
    _compressed,
    _latent,
    _window_pattern,
    _qwen_window,
    _plain_attention,
)
