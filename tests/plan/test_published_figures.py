"""The planner's figures on published model configs, checked against figures the model authors
or engine makers publish; where none is published, against a hand computation from the config
written out in the test (said so in each test's docstring).

The configs under ``configs/`` are written from the models' published ``config.json`` values
(see ``configs/README.md``).
"""

from __future__ import annotations

import math

import pytest

from gpusnap.cli.plan import families
from gpusnap.cli.plan.shapes import Kind
from gpusnap.errors import InvalidArgument, Unsupported
from tests.plan._plan import GiB, config, kind, plan_for

K256 = 256 * 1024


# -- full / grouped-query attention -------------------------------------------------------


def test_llama2_7b_kv_cache_at_4096_tokens_is_nvidias_2gb() -> None:
    """NVIDIA Technical Blog, "Mastering LLM Techniques: Inference Optimization" (2023):
    Llama 2 7B, 16-bit, batch 1, 4096 tokens: 1 x 4096 x 2 x 32 x 4096 x 2 bytes ≈ 2 GB."""
    for engine in ("vllm", "sglang"):
        plan = plan_for("llama-2-7b", engine=engine, context=4096)
        assert plan.state_bytes_per_session == 1 * 4096 * 2 * 32 * 4096 * 2 == 2 * GiB


def test_jamba_paper_kv_cache_at_256k_tokens_llama2_128gb_jamba_4gb() -> None:
    """Jamba paper (Lieber et al. 2024, arXiv 2403.19887), Table 1, KV cache at 256K
    context in 16 bits: Llama-2 6.7B 128GB, Jamba 4GB (1 attention layer in 8)."""
    llama = plan_for("llama-2-7b", engine="sglang", context=K256)
    assert llama.kv_bytes_per_token * K256 == 128 * GiB
    jamba = plan_for("jamba-v0.1", engine="sglang", context=K256)
    assert jamba.kv_bytes_per_token * K256 == 4 * GiB
    assert kind(jamba, Kind.FULL).layers == 4 and kind(jamba, Kind.MAMBA1).layers == 28


def test_mistral_7b_per_token_kv_is_the_jamba_papers_32gb_but_its_window_caps_it() -> None:
    """Jamba paper Table 1: Mistral 7.2B, 32GB at 256K tokens: its 131072 bytes per token
    counted over the whole context. Mistral-7B-v0.1 windows every layer at 4096 tokens, so
    what an engine holds stops growing there: within the window the per-token figure is the
    paper's; past it, nothing grows (kv_bytes_per_token is 0)."""
    within = plan_for("mistral-7b-v0.1", engine="sglang", context=4096)
    assert within.state_bytes_per_session // 4096 * K256 == 32 * GiB
    beyond = plan_for("mistral-7b-v0.1", engine="sglang", context=K256)
    assert beyond.state_bytes_per_session == within.state_bytes_per_session
    assert beyond.kv_bytes_per_token == 0
    assert kind(beyond, Kind.SLIDING).layers == 32


def test_llama31_8b_gqa_kv_per_token_from_8_kv_heads() -> None:
    """Hand computation (no published per-token figure for this exact model): 2 (K, V) x
    32 layers x 8 KV heads x (4096 / 32 = 128) head size x 2 bytes = 131072."""
    plan = plan_for("llama-3.1-8b")
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072


def test_llama31_70b_kv_heads_split_across_8_gpus() -> None:
    """Hand computation: 8 KV heads over tp 8 is one head per GPU: 2 x 80 x 1 x 128 x 2 per
    GPU; a node holds all eight."""
    plan = plan_for("llama-3.1-70b", tp=8)
    assert plan.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    assert plan.to_json()["kv_bytes_per_token"]["per_node"] == 2 * 80 * 8 * 128 * 2


def test_qwen3_32b_takes_head_dim_from_the_config_not_hidden_size() -> None:
    """Hand computation: Qwen3-32B gives head_dim 128 while hidden_size / heads is 80:
    2 x 64 layers x 8 KV heads x 128 x 2 = 262144 bytes per token."""
    data = config("qwen3-32b")
    assert data["hidden_size"] // data["num_attention_heads"] == 80
    assert plan_for(data).kv_bytes_per_token == 2 * 64 * 8 * 128 * 2


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    """Hand computation: Qwen3-Next has 2 KV heads; at tp 4 every GPU still holds one
    (vLLM replicates), so per GPU is half of tp 1's, not a quarter."""
    one = plan_for("qwen3-next-80b-a3b")
    four = plan_for("qwen3-next-80b-a3b", tp=4)
    assert four.kv_bytes_per_token == one.kv_bytes_per_token / 2


# -- sliding windows ----------------------------------------------------------------------


def test_gemma3_27b_five_local_layers_per_global_from_text_config() -> None:
    """Gemma 3 Technical Report (2025): five local layers per global layer, local span 1024.
    The fields sit under text_config; the pattern is the config class's default (6)."""
    plan = plan_for("gemma-3-27b-it", context=32768)
    assert kind(plan, Kind.FULL).layers == 10 and kind(plan, Kind.SLIDING).layers == 52
    assert kind(plan, Kind.SLIDING).window == 1024
    # Hand computation: only the 10 global layers grow: 2 x 10 x 16 heads x 128 x 2.
    assert plan.kv_bytes_per_token == 2 * 10 * 16 * 128 * 2


def test_gpt_oss_alternates_banded_128_token_windows_by_layer_types() -> None:
    """gpt-oss model card (OpenAI 2025): alternating dense and locally banded attention with a
    bandwidth of 128 tokens (layer_types in the config)."""
    plan = plan_for("gpt-oss-20b", context=32768)
    assert kind(plan, Kind.SLIDING).layers == 12 and kind(plan, Kind.FULL).layers == 12
    # Hand computation from vLLM's SlidingWindowManager: blocks of 16 wholly before
    # context - 128 + 1 are freed. At 32768 tokens that leaves 8 blocks; one token later,
    # the window straddles 9.
    assert kind(plan, Kind.SLIDING).entries_per_session == 12 * 128
    later = plan_for("gpt-oss-20b", context=32770)
    assert kind(later, Kind.SLIDING).entries_per_session == 12 * 144
    assert plan.kv_bytes_per_token == 2 * 12 * 8 * 64 * 2


def test_qwen2_windows_only_with_use_sliding_window_from_max_window_layers() -> None:
    """Qwen2-7B-Instruct publishes use_sliding_window false: every layer is full. The same
    config with it switched on (a variant, not a published one) windows layers
    i >= max_window_layers."""
    data = config("qwen2-7b-instruct")
    plan = plan_for(data)
    assert [k.kind for k in plan.kinds] == [Kind.FULL]
    variant = {**data, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    windowed = plan_for(variant)
    assert kind(windowed, Kind.FULL).layers == 20 and kind(windowed, Kind.SLIDING).layers == 8
    # Hand computation: 28 layers x 4 KV heads x (3584 / 28 = 128) x 2 x 2 bytes.
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


# -- latent attention ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "layers"), [("deepseek-v2-lite", 27), ("deepseek-v3", 61)])
def test_mla_kv_per_token_is_the_deepseek_v2_papers_formula(name: str, layers: int) -> None:
    """DeepSeek-V2 paper (arXiv 2405.04434), Table 1: MLA caches (d_c + d_h^R)·l elements
    per token, with d_c = 4·d_h (512) and d_h^R = d_h/2 (64): 9/2·d_h·l, no factor 2 for
    K and V and no KV heads. The configs carry num_key_value_heads, which must not count."""
    data = config(name)
    d_h = data["qk_nope_head_dim"]
    assert data["kv_lora_rank"] == 4 * d_h and data["qk_rope_head_dim"] == d_h // 2
    plan = plan_for(data)
    assert plan.kv_bytes_per_token == 9 * d_h * layers // 2 * 2  # bf16
    assert plan.engine.block_size == 64  # vLLM's FlashMLA block


def test_mla_latent_is_not_split_across_tensor_parallel_ranks() -> None:
    """vLLM MLAAttentionSpec / SGLang MLATokenToKVPool: every rank holds the whole latent."""
    one = plan_for("deepseek-v3")
    eight = plan_for("deepseek-v3", tp=8)
    assert eight.kv_bytes_per_token == one.kv_bytes_per_token
    assert eight.to_json()["kv_bytes_per_token"]["per_node"] == 8 * one.kv_bytes_per_token


# -- compressed layouts -------------------------------------------------------------------


def test_deepseek_v4_compressed_entries_are_window_plus_context_over_stride() -> None:
    """Hand computation (no published per-token figure): DeepSeek-V4-Flash-Base's
    compress_ratios has 44 entries for 43 layers (the last is the MTP layer, cut off): 2
    window-only layers, 21 at stride 4, 20 at stride 128; each entry one 512-wide latent."""
    data = config("deepseek-v4-flash-base")
    assert len(data["compress_ratios"]) == data["num_hidden_layers"] + 1
    L, W = 32768, 128
    plan = plan_for(data, context=L)
    entries = 2 * W + 21 * (W + math.ceil(L / 4)) + 20 * (W + math.ceil(L / 128))
    assert kind(plan, Kind.COMPRESSED).entries_per_session == entries
    assert plan.state_bytes_per_session == entries * 512 * 2
    assert plan.kv_bytes_per_token == 21 * 512 * 2 / 4 + 20 * 512 * 2 / 128


# -- state-space and linear attention -----------------------------------------------------


def test_jamba_mamba1_state_is_fixed_per_session_and_fp8_leaves_it_alone() -> None:
    """Hand computation (vLLM mamba1_state_shape): d_inner = 2 x 4096; conv (8192, 3),
    recurrent (8192, 16), bf16, 28 layers. fp8 KV halves the attention only."""
    per_layer = (8192 * 3 + 8192 * 16) * 2
    sg = plan_for("jamba-v0.1", engine="sglang")  # SGLang keeps the SSM state in fp32
    assert kind(sg, Kind.MAMBA1).state_bytes_per_session == 28 * (8192 * 3 * 2 + 8192 * 16 * 4)
    short = plan_for("jamba-v0.1", engine="sglang", context=10)
    long = plan_for("jamba-v0.1", engine="sglang", context=100_000)
    assert (
        kind(short, Kind.MAMBA1).state_bytes_per_session
        == kind(long, Kind.MAMBA1).state_bytes_per_session
    )
    bf16 = plan_for("jamba-v0.1")
    fp8 = plan_for("jamba-v0.1", kv_dtype="fp8")
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    # vLLM pads the state page to one attention page; fp8 halves the attention page, so
    # the padding differs, never below the state itself.
    for p in (bf16, fp8):
        assert kind(p, Kind.MAMBA1).state_bytes_per_session >= 28 * per_layer


def test_nemotron_h_pattern_counts_and_mamba2_state() -> None:
    """Nemotron-H paper (NVIDIA 2025, arXiv 2504.03624): Nemotron-H-8B has 52 layers, 4 of
    them self-attention (about 8%), 24 Mamba-2, the rest MLP. State by hand (vLLM
    mamba2_state_shape): conv (128·64 + 2·8·128, 3), recurrent (128, 64, 128)."""
    plan = plan_for("nemotron-h-8b-base-8k", engine="sglang")
    assert kind(plan, Kind.FULL).layers == 4 and kind(plan, Kind.MAMBA2).layers == 24
    conv = (128 * 64 + 2 * 8 * 128) * 3 * 2
    assert kind(plan, Kind.MAMBA2).state_bytes_per_session == 24 * (conv + 128 * 64 * 128 * 4)
    # tp 3 divides neither the heads nor the groups: the engine would refuse, so do we.
    with pytest.raises(InvalidArgument, match="does not divide"):
        plan_for("nemotron-h-8b-base-8k", tp=3)


def test_qwen3_next_three_deltanet_layers_per_attention_layer_and_vllm_page_padding() -> None:
    """Qwen3-Next announcement (Qwen team 2025): a 3:1 mix of Gated DeltaNet and gated
    attention (full_attention_interval 4). Hand computation of vLLM's
    HybridAttentionMambaModelConfig: attention page of one token 2·2·256·2 = 2048 bytes; a
    DeltaNet page (8192·3 + 32·128·128)·2 = 1097728; block 16·⌈1097728 / (16·2048)⌉ = 544
    tokens; the state page padded by 1.49% to 544·2048 bytes."""
    plan = plan_for("qwen3-next-80b-a3b")
    assert kind(plan, Kind.GATED_DELTANET).layers == 36 and kind(plan, Kind.FULL).layers == 12
    raw = (8192 * 3 + 32 * 128 * 128) * 2
    assert raw == 1097728
    assert plan.engine.block_size == 544
    assert plan.engine.state_page == 544 * 2048
    assert round(100 * (544 * 2048 - raw) / raw, 2) == 1.49
    assert kind(plan, Kind.GATED_DELTANET).state_bytes_per_session == 36 * 544 * 2048
    assert plan.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2


def test_kimi_linear_kda_cuts_latent_kv_by_the_reported_75_percent() -> None:
    """Kimi Linear tech report (Moonshot AI 2025): KV cache reduced "by up to 75%" against
    full MLA: 7 MLA layers of 27 (3:1 KDA to MLA). KDA state by hand (vLLM kda_state_shape
    and kda_state_dtype): conv (3·32·128, 3) in bf16, recurrent (32, 128, 128) in float32."""
    data = config("kimi-linear-48b-a3b")
    plan = plan_for(data)
    assert kind(plan, Kind.MLA).layers == 7 and kind(plan, Kind.KDA).layers == 20
    all_mla = {k: v for k, v in data.items() if k != "linear_attn_config"}
    full = plan_for(all_mla)
    reduction = 1 - plan.kv_bytes_per_token / full.kv_bytes_per_token
    assert 0.74 < reduction <= 0.75
    sg = plan_for(data, engine="sglang")
    assert kind(sg, Kind.KDA).state_bytes_per_session == 20 * (
        3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4
    )


# -- what is not known is not guessed -----------------------------------------------------


def test_unknown_architecture_names_the_fields_it_lacks() -> None:
    bare = {"architectures": ["MysteryForCausalLM"], "num_hidden_layers": 4, "vocab_size": 10}
    with pytest.raises(Unsupported, match="lacks num_attention_heads or n_head, hidden_size"):
        families.shape_from_config(bare)


def test_an_unknown_layer_kind_is_refused_by_name() -> None:
    data = {**config("gpt-oss-20b"), "layer_types": ["sliding_attention", "chunked_attention"] * 12}
    with pytest.raises(Unsupported, match="chunked_attention"):
        families.shape_from_config(data)


def test_a_family_missing_one_of_its_fields_is_refused_by_name() -> None:
    data = config("qwen3-next-80b-a3b")
    del data["linear_value_head_dim"]
    with pytest.raises(Unsupported, match="linear_value_head_dim"):
        families.shape_from_config(data)
