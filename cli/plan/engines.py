"""Each serving engine's accounting: element sizes, block rounding, state pages, the pool.

vLLM (``vllm/v1/kv_cache_interface.py``, ``model_executor/models/config.py``,
``layers/mamba/mamba_utils.py``, ``v1/worker/gpu_worker.py``) allocates attention KV in
blocks of ``block_size`` tokens (16; 64 for latent attention, which FlashMLA needs), frees
the blocks a sliding window has left behind, pads state-space pages to the attention page
of hybrid models, and sizes its pool as ``gpu_memory x gpu_memory_utilization`` less the
weights and what its profiling run measured (activations, non-torch allocations).

SGLang (``mem_cache/memory_pool.py``, ``model_executor/model_runner.py``) keeps one token per
page, keeps the SSM state in float32 by default (``--mamba-ssm-dtype``), and sizes its pool
as ``free memory x mem_fraction_static`` less the weights.

Every figure here is per tensor-parallel rank (per GPU); a node holds ``tp`` of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusnap.cli.plan.shapes import AttentionShape, Kind, ModelShape, StateShape
from gpusnap.errors import InvalidArgument

GiB = 1 << 30

ENGINES = ("vllm", "sglang")
KV_DTYPES = ("auto", "bf16", "fp8")

VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM --gpu-memory-utilization
VLLM_BLOCK_SIZE = 16
VLLM_MLA_BLOCK_SIZE = 64  # FlashMLA's kernel block; vLLM sets it for MLA models on CUDA
VLLM_HYBRID_ALIGN = 16  # attention kernels' block alignment (FlashAttention)
# What vLLM's profiling run measures beside the weights, modelled (no GPU here to run it):
# non-torch allocations (NCCL, cuBLAS workspaces) plus the peak activations of one step of
# max_num_batched_tokens tokens and the sampler's float32 logits for max_num_seqs sequences.
VLLM_NON_TORCH_BYTES = 1 * GiB
VLLM_PROFILE_TOKENS = 8192
VLLM_PROFILE_SEQS = 256
# SGLang's long-standing mem_fraction_static defaults by tensor-parallel size (newer
# releases derive it from GPU memory and the chunked-prefill size: pass the value it logs).
SGLANG_FRACTION_BY_TP = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))
# Taken before SGLang measures the free memory its fraction applies to.
SGLANG_CONTEXT_BYTES = 1 * GiB


@dataclass(frozen=True)
class Engine:
    """An engine with its settings resolved for one model."""

    name: str
    tp: int
    kv_dtype: str
    kv_bytes: int  # per attention element
    conv_bytes: int  # per convolution-state element
    ssm_bytes: int  # per recurrent-state element (KDA's is float32 regardless)
    block_size: int  # tokens per attention block (1: SGLang's page)
    state_page: int | None  # bytes per state layer and session on a rank (vLLM pads it)
    utilization: float


def resolve(
    model: ModelShape,
    name: str,
    *,
    tp: int = 1,
    kv_dtype: str = "auto",
    block_size: int | None = None,
    utilization: float | None = None,
) -> Engine:
    if name not in ENGINES:
        raise InvalidArgument(f"unknown engine {name!r}; one of {', '.join(ENGINES)}")
    if kv_dtype not in KV_DTYPES:
        raise InvalidArgument(f"unknown --kv-dtype {kv_dtype!r}; one of {', '.join(KV_DTYPES)}")
    if tp < 1:
        raise InvalidArgument("--tp must be at least 1")
    kv_bytes = {"auto": model.dtype_bytes, "bf16": 2, "fp8": 1}[kv_dtype]
    conv_bytes = model.dtype_bytes  # mamba_cache_dtype "auto": the model's dtype
    if name == "sglang":
        ssm_bytes = 4  # --mamba-ssm-dtype float32
    elif model.model_type == "nemotron_h":
        # vLLM NemotronHForCausalLMConfig: the config's mamba_ssm_cache_dtype, else float16.
        ssm_bytes = model.ssm_dtype_bytes or 2
    else:
        ssm_bytes = model.dtype_bytes
    if utilization is None:
        utilization = (
            VLLM_DEFAULT_UTILIZATION
            if name == "vllm"
            else next(f for n, f in SGLANG_FRACTION_BY_TP if tp >= n)
        )
    if not 0 < utilization <= 1:
        raise InvalidArgument("--gpu-memory-utilization must be in (0, 1]")
    engine = Engine(name, tp, kv_dtype, kv_bytes, conv_bytes, ssm_bytes, 1, None, utilization)
    for layer in model.layers:
        if isinstance(layer, StateShape):
            state_bytes(engine, layer)  # a tp that does not divide the state is an error now
    if name == "sglang":
        if block_size not in (None, 1):
            raise InvalidArgument(
                "SGLang keeps one token per page here: --block-size applies to vllm"
            )
        return engine
    return _vllm_blocks(engine, model, block_size)


def _vllm_blocks(engine: Engine, model: ModelShape, requested: int | None) -> Engine:
    """vLLM's block size, and for hybrid models ``HybridAttentionMambaModelConfig``: the
    smallest aligned attention block whose page holds one state page, then the state page
    padded to exactly one attention page."""
    attention = [x for x in model.layers if isinstance(x, AttentionShape)]
    states = [x for x in model.layers if isinstance(x, StateShape)]
    latent = any(x.kind in (Kind.MLA, Kind.COMPRESSED) for x in attention)
    if requested is not None and requested < 1:
        raise InvalidArgument("--block-size must be at least 1")
    block = requested or (VLLM_MLA_BLOCK_SIZE if latent else VLLM_BLOCK_SIZE)
    state_page = max((sum(state_bytes(engine, s)) for s in states), default=None)
    if state_page is not None and attention:
        one_token = token_bytes(engine, attention[0])
        align = VLLM_MLA_BLOCK_SIZE if latent else VLLM_HYBRID_ALIGN
        needed = align * ceil_div(state_page, align * one_token)
        if requested is None or requested < needed:
            block = needed
        if state_page > block * one_token:
            block = ceil_div(state_page, one_token)
        state_page = block * one_token
    return Engine(
        engine.name,
        engine.tp,
        engine.kv_dtype,
        engine.kv_bytes,
        engine.conv_bytes,
        engine.ssm_bytes,
        block,
        state_page,
        engine.utilization,
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def token_bytes(engine: Engine, layer: AttentionShape) -> int:
    """Bytes one cache entry (one token; a compressed layer's entry) takes on one rank.
    Split layers hold ``max(1, kv_heads // tp)`` heads: replicated when tp exceeds them."""
    heads = max(1, layer.kv_heads // engine.tp) if layer.split_by_tp else layer.kv_heads
    return heads * (layer.head_dim + layer.head_dim_v) * engine.kv_bytes


def entries_held(engine: Engine, layer: AttentionShape, context: int) -> int:
    """Cache entries one session of ``context`` tokens holds in one layer.

    Full and latent layers: every token, in whole blocks. Windowed layers (vLLM
    ``SlidingWindowManager``): blocks wholly before ``context - window + 1`` are freed;
    SGLang's SWA pool keeps ``min(context, window)``. Compressed layers:
    ``min(context, window) + ⌈context/stride⌉``, unrounded.
    """
    b = engine.block_size
    if layer.kind in (Kind.FULL, Kind.MLA):
        return ceil_div(context, b) * b
    window = layer.window or 0
    if layer.kind == Kind.SLIDING:
        if engine.name == "sglang":
            return min(context, window)
        skipped = max(0, context - window + 1) // b
        return (ceil_div(context, b) - skipped) * b
    compressed = ceil_div(context, layer.stride) if layer.stride else 0
    return min(context, window) + compressed


def growth_per_token(engine: Engine, layer: AttentionShape) -> float:
    """Bytes a layer adds per token of context once every window is full."""
    if layer.kind in (Kind.FULL, Kind.MLA):
        return float(token_bytes(engine, layer))
    if layer.kind == Kind.COMPRESSED and layer.stride:
        return token_bytes(engine, layer) / layer.stride
    return 0.0


def state_bytes(engine: Engine, layer: StateShape) -> tuple[int, int]:
    """(convolution, recurrent) bytes of one state layer for one session on one rank."""
    tp = engine.tp
    channels = layer.conv_channels
    if layer.kind == Kind.MAMBA2 and layer.n_groups % tp:
        # vLLM extra_groups_for_head_shards: groups are replicated so each head has its own.
        channels = layer.d_inner + 2 * (layer.n_groups + tp - layer.n_groups) * layer.d_state
    for what, n in (("convolution channels", channels), ("state heads", layer.rec_heads)):
        if n % tp:
            raise InvalidArgument(
                f"--tp {tp} does not divide the {n} {what} of the {layer.kind} layers"
            )
    ssm = 4 if layer.rec_fp32 else engine.ssm_bytes
    conv = channels // tp * layer.conv_len * engine.conv_bytes
    return conv, layer.rec_heads // tp * layer.rec_inner * ssm


def session_state_bytes(engine: Engine, layer: StateShape) -> int:
    """What one session's state takes in one state layer on one rank (vLLM: a padded page)."""
    if engine.state_page is not None:
        return engine.state_page
    return sum(state_bytes(engine, layer))


def overhead_bytes(engine: Engine, model: ModelShape) -> int:
    """Device memory beside the weights and the pool, per rank: modelled on what vLLM's
    profiling run subtracts (``VLLM_*`` above); used for SGLang's device total too."""
    per_token = 4 * model.hidden_size + 2 * model.intermediate_size // engine.tp
    activations = VLLM_PROFILE_TOKENS * per_token * model.dtype_bytes
    logits = VLLM_PROFILE_SEQS * model.vocab_size * 4
    return VLLM_NON_TORCH_BYTES + activations + logits


def pool_bytes(engine: Engine, gpu_memory: int, weights_per_gpu: int, overhead: int) -> int:
    """The KV/state pool one rank pre-allocates.

    vLLM: ``gpu_memory x utilization - weights - overhead`` (``gpu_worker``'s
    ``requested_memory - non_kv_cache_memory``). SGLang: ``(gpu_memory - context) x
    mem_fraction_static - weights`` (``profile_max_num_token``: free memory after loading
    less ``free x (1 - fraction)``); its activations live in the remaining fraction.
    """
    if engine.name == "vllm":
        pool = int(gpu_memory * engine.utilization) - weights_per_gpu - overhead
    else:
        pool = int((gpu_memory - SGLANG_CONTEXT_BYTES) * engine.utilization) - weights_per_gpu
    if pool <= 0:
        raise InvalidArgument(
            f"no room for a KV pool: {gpu_memory} bytes of GPU memory at utilization "
            f"{engine.utilization} do not hold {weights_per_gpu} bytes of weights per GPU "
            f"and {overhead} bytes of overhead"
        )
    return pool
