"""Golden figures for the models in docs/kv-accounting.md section 6. Every expected number is written as the
arithmetic that produces it, so a reader can check it by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbudget.accounting import EngineShape, capacity, cdiv, layout
from kvbudget.model import ModelError, shape_from_config
from kvbudget.model_files import read_model
from kvbudget.plan_types import PlanError, Platform, Targets
from kvbudget.planner import make_plan
from kvbudget.profiles import UnknownGpu, custom_profile, find_profile
from tests.support import REPO

FIX = REPO / "tests" / "fixtures" / "models"
GiB = 1 << 30


def model(name: str):
    return read_model(FIX / f"{name}.json")


# -- per-token KV (the figures a reader checks first) -------------------------------------------


@pytest.mark.parametrize(
    "name, layers, kv_heads, head_dim",
    [
        ("llama-3.1-8b", 32, 8, 128),  # 128 KiB/token in bf16
        ("qwen3-8b", 36, 8, 128),
        ("qwen2.5-7b", 28, 4, 128),  # sliding_window present but use_sliding_window = false: all full
        ("qwen3.6-27b", 16, 4, 256),  # only the 16 full-attention layers of 64 keep KV
        ("qwen3.5-9b", 8, 4, 256),
        ("qwen3.5-35b-a3b", 10, 2, 256),
        ("qwen3-next-80b-a3b", 12, 2, 256),
    ],
)
@pytest.mark.parametrize("kv_dtype, elem", [("bf16", 2), ("fp8", 1)])
def test_per_token_kv(name, layers, kv_heads, head_dim, kv_dtype, elem):
    lay = layout(model(name), EngineShape(max_model_len=4096, kv_dtype=kv_dtype))
    assert lay.per_token_kv_bytes == 2 * kv_heads * head_dim * elem * layers


def test_seed_example_per_token_figures():
    m = model("qwen3.6-27b")
    assert m.kv_layers == 16 and m.count("linear") == 48
    assert layout(m, EngineShape(4096, kv_dtype="bf16")).per_token_kv_bytes == 65_536 == 2 * 16 * 4 * 256 * 2
    assert layout(m, EngineShape(4096, kv_dtype="fp8")).per_token_kv_bytes == 32_768


# -- hybrid Gated DeltaNet: state, block size, padding, groups ---------------------------------


def test_qwen36_linear_state_and_block_alignment():
    m = model("qwen3.6-27b")
    conv_dim = 128 * 16 * 2 + 128 * 48  # 10,240
    state = (4 - 1) * conv_dim * 2 + 48 * 128 * 128 * 4  # conv (bf16) + recurrent state (float32)
    assert state == 3_207_168
    for kv_dtype, per_tok in (("bf16", 2 * 4 * 256 * 2), ("fp8", 2 * 4 * 256)):
        lay = layout(m, EngineShape(32_768, kv_dtype=kv_dtype))
        block = 16 * cdiv(state, 16 * per_tok)  # Platform._align_hybrid_block_size
        assert lay.block_size == block == {"bf16": 784, "fp8": 1568}[kv_dtype]
        assert lay.page_bytes == block * per_tok == 3_211_264
        assert lay.mamba_page_real == state
        assert lay.mamba_padding_pct == pytest.approx(100 * (3_211_264 - state) / state)
        # 48 linear and 16 full layers: groups of 16 (the smaller count), 3 linear groups + 1 full
        assert [g.kind for g in lay.groups] == ["linear", "linear", "linear", "full"]
        assert lay.group_size == 16 and lay.bytes_per_block == 16 * 3_211_264


def test_qwen36_blocks_per_request_by_mamba_mode():
    m = model("qwen3.6-27b")
    e = EngineShape(32_768, kv_dtype="fp8")
    full = cdiv(32_768, 1568)  # 21
    assert layout(m, e).blocks_per_request(e) == full + 3 * 2  # align: 2 states per linear group
    e_none = replace(e, mamba_cache_mode="none")
    assert layout(m, e_none).blocks_per_request(e_none) == full + 3 * 1
    e_all = replace(e, mamba_cache_mode="all")
    assert layout(m, e_all).blocks_per_request(e_all) == full + 3 * cdiv(32_768, 1568)


def test_qwen36_capacity_and_both_reported_figures():
    m = model("qwen3.6-27b")
    e = EngineShape(32_768, kv_dtype="fp8")
    lay = layout(m, e)
    pool = 60 * GiB
    cap = capacity(lay, e, pool)
    blocks = pool // (16 * 3_211_264)
    assert cap.num_blocks == blocks
    assert cap.max_concurrency == blocks / (21 + 6)
    assert cap.tokens_reported == int(blocks / 27 * 32_768)
    assert cap.tokens_reported_legacy == blocks // 4 * 1568  # older vLLM: understates hybrid pools


def test_qwen3_next_state_in_bf16():
    m = model("qwen3-next-80b-a3b")  # no mamba_ssm_dtype: the state follows the model dtype
    state = 3 * (128 * 16 * 2 + 128 * 32) * 2 + 32 * 128 * 128 * 2
    lay = layout(m, EngineShape(8192, kv_dtype="bf16"))
    assert lay.mamba_page_real == state == 1_097_728
    assert lay.block_size == 16 * cdiv(state, 16 * 2048) == 544
    assert lay.group_size == 12 and len(lay.groups) == 4


def test_cpu_block_size_aligns_hybrid_blocks_to_128():
    m = model("qwen3.5-9b")
    state = 3 * (128 * 16 * 2 + 128 * 32) * 2 + 32 * 128 * 128 * 4
    lay = layout(m, EngineShape(4096, kv_dtype="bf16", block_size=128, kernel_block=128))
    assert lay.block_size == 128 * cdiv(state, 128 * 4096)


# -- sliding window ------------------------------------------------------------------------------


def test_gpt_oss_sliding_window_groups_and_blocks():
    m = model("gpt-oss-20b")
    assert m.count("sliding") == 12 and m.count("full") == 12 and m.sliding_window == 128
    e = EngineShape(131_072, kv_dtype="bf16", max_num_batched_tokens=8192, max_concurrent_batches=2)
    lay = layout(m, e)
    page = 16 * 2 * 8 * 64 * 2
    assert lay.page_bytes == page and lay.group_size == 12 and lay.bytes_per_block == 12 * page
    sliding = cdiv(min(128 - 1 + 2 * 8192, 131_072), 16) + 1  # window plus in-flight tokens, +1 for alignment
    assert lay.blocks_per_request(e) == cdiv(131_072, 16) + sliding


def test_uneven_counts_pad_groups():
    # 20 full + 30 sliding: group size 20 (30 >= 1.5 x 20), sliding split in 2 groups of 15 (+5 padding each)
    cfg = {"architectures": ["X" + "ForCausalLM"], "num_hidden_layers": 50, "num_attention_heads": 8,
           "num_key_value_heads": 8, "hidden_size": 512, "sliding_window": 256,
           "layer_types": ["full_attention"] * 20 + ["sliding_attention"] * 30}
    lay = layout(shape_from_config(cfg), EngineShape(4096))
    assert lay.group_size == 20 and [g.layers for g in lay.groups] == [20, 15, 15]
    assert lay.bytes_per_block == 20 * lay.page_bytes


# -- speculative decoding, parallelism, MLA, FP4 -----------------------------------------------------


def test_ngram_enlarges_conv_state_and_state_blocks():
    m = model("qwen3.6-27b")
    e = EngineShape(32_768, kv_dtype="fp8", spec_method="ngram", num_speculative_tokens=3)
    lay = layout(m, e)
    assert lay.mamba_page_real == (4 - 1 + 3) * 10_240 * 2 + 48 * 128 * 128 * 4
    assert lay.blocks_per_request(e) == cdiv(32_768, lay.block_size) + 3 * (2 + 3)


def test_eagle_draft_layer_joins_the_pool():
    m = model("llama-3.1-8b")
    e = EngineShape(8192, kv_dtype="bf16", spec_method="eagle3", num_speculative_tokens=3, draft_layers=1)
    lay = layout(m, e)
    assert lay.bytes_per_block == 33 * 16 * 2 * 8 * 128 * 2  # (L + 1) / L per token
    assert lay.per_token_kv_bytes == 33 * 4096


def test_tensor_parallel_splits_heads_and_replicates_past_them():
    m = model("llama-3.1-8b")
    assert layout(m, EngineShape(4096, tp=2)).page_bytes == 16 * 2 * 4 * 128 * 2
    q = model("qwen3.6-27b")
    lay = layout(q, EngineShape(4096, kv_dtype="fp8", tp=8))
    assert lay.kv_heads_per_rank == 1 and lay.kv_heads_replicated
    assert any("replicated" in n for n in lay.notes)


def test_decode_context_parallel_shards_tokens():
    m = model("llama-3.1-8b")
    e = EngineShape(65_536, tp=16, dcp=2)
    assert layout(m, e).blocks_per_request(e) == cdiv(cdiv(65_536, 2), 16)
    cap = capacity(layout(m, e), e, 10 * GiB)
    assert cap.tokens_reported_legacy == cap.num_blocks * 16 * 2


def test_mla_page_has_one_latent():
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "max_position_embeddings": 163_840, "torch_dtype": "bfloat16"}
    lay = layout(shape_from_config(cfg), EngineShape(4096, kv_dtype="bf16"))
    assert lay.page_bytes == 16 * (512 + 64) * 2 and lay.per_token_kv_bytes == 61 * 576 * 2


def test_fp4_kv_halves_fp8():
    m = model("llama-3.1-8b")
    assert layout(m, EngineShape(4096, kv_dtype="fp4")).per_token_kv_bytes == 32 * 2 * 8 * 128 // 2


# -- model reading ------------------------------------------------------------------------------------


def test_safetensors_headers_give_exact_weight_bytes(tmp_path):
    import json
    import struct

    (tmp_path / "config.json").write_text((FIX / "llama-3.1-8b.json").read_text())
    header = {"a": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]},
              "b": {"dtype": "F32", "shape": [10], "data_offsets": [64, 104]}, "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (tmp_path / "model-00001.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 104)
    m = read_model(tmp_path)
    assert m.weight_bytes == 104 and m.weight_bytes_exact


def test_bare_config_weights_are_labelled_estimates():
    m = model("llama-3.1-8b")
    assert not m.weight_bytes_exact and "estimated" in m.notes[0]
    assert 15e9 < m.weight_bytes < 17e9  # Llama-3.1-8B ships 16.06 GB of bf16 safetensors


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"architectures": ["BertForMaskedLM"], "num_hidden_layers": 2}, "not a causal language model"),
        ({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "hidden_size": 64}, "num_hidden_layers"),
        ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 64},
         "positive integer"),
        ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64,
          "layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({}, "names no architecture"),
    ],
)
def test_bad_configs_say_what_is_wrong(cfg, message):
    with pytest.raises(ModelError, match=message):
        shape_from_config(cfg)


# -- the planner ---------------------------------------------------------------------------------------


def test_plan_passes_an_exact_pool_of_whole_blocks():
    p = make_plan(model("llama-3.1-8b"), find_profile("RTX PRO 6000 Blackwell"), Targets(context=32_768))
    m = p.memory
    assert m.total == 97_887 * (1 << 20)
    assert m.headroom == m.total - int(m.total * 0.92)
    assert m.kv_pool % p.layout.bytes_per_block == 0
    assert m.kv_pool + m.unused == int(m.total * 0.92) - m.weights - m.reserve
    args = list(p.vllm_args)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(m.kv_pool)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"  # Blackwell supports FP8 KV


def test_no_fp8_flag_where_the_gpu_lacks_it():
    p = make_plan(model("llama-3.1-8b"), find_profile("RTX A6000"), Targets(context=8192))
    assert "--kv-cache-dtype" not in p.vllm_args and any("no FP8" in n for n in p.notes)
    with pytest.raises(PlanError, match=r"compute capability 8\.9"):
        make_plan(model("llama-3.1-8b"), find_profile("RTX A6000"), Targets(kv_dtype="fp8"))
    with pytest.raises(PlanError, match="Blackwell"):
        make_plan(model("llama-3.1-8b"), find_profile("H100"), Targets(kv_dtype="fp4"))


def test_unmet_target_says_by_how_much_and_what_would_meet_it():
    p = make_plan(model("qwen3.6-27b-fp8"), find_profile("RTX PRO 6000 Blackwell"), Targets(sessions=50, context=32_768))
    assert p.fits and not p.targets_met
    f = next(f for f in p.findings if f.target == "sessions")
    assert f.shortfall_pct == pytest.approx(100 * (50 - p.capacity.max_concurrency) / 50)
    text = " ".join(f.remedies)
    assert "fewer sessions" in text and "shorter context" in text and "bigger card" in text
    met = make_plan(model("qwen3.6-27b-fp8"), find_profile("RTX PRO 6000 Blackwell"), Targets(sessions=40, context=32_768))
    assert met.targets_met and met.max_num_seqs == 40


def test_bf16_plan_suggests_fp8():
    p = make_plan(model("llama-3.1-8b"), find_profile("RTX PRO 6000 Blackwell"),
                  Targets(sessions=100, context=32_768, kv_dtype="bf16"))
    assert any(r.startswith("FP8 KV cache:") for f in p.findings for r in f.remedies)


def test_a_397b_moe_does_not_fit_one_card():
    p = make_plan(model("qwen3.5-397b-a17b"), find_profile("RTX PRO 6000 Blackwell"))
    assert not p.fits and p.findings[0].target == "fit" and p.vllm_args == ()
    assert "weights alone" in p.findings[0].remedies[0]


def test_speculative_rules():
    gpu = find_profile("RTX PRO 6000 Blackwell")
    code = make_plan(model("llama-3.1-8b"), gpu, Targets(workload="code"))
    assert code.speculative.method == "ngram" and '"method":"ngram"' in " ".join(code.vllm_args)
    gdn = make_plan(model("qwen3.6-27b"), gpu, Targets(workload="code"))
    assert gdn.speculative.method == "none" and "39273" in gdn.speculative.reason
    tools = make_plan(model("llama-3.1-8b"), gpu, Targets(workload="tool-calling"))
    assert tools.speculative.method == "none" and "--speculative-config" not in tools.vllm_args
    eagle = make_plan(model("llama-3.1-8b"), gpu, Targets(draft_model="/srv/drafts/eagle3", draft_model_bytes=750_000_000,
                                                           draft_layers=1))
    assert eagle.speculative.method == "eagle3" and eagle.memory.draft_weights == 750_000_000
    assert eagle.layout.bytes_per_block == 33 * eagle.layout.page_bytes
    assert '"model":"/srv/drafts/eagle3"' in " ".join(eagle.vllm_args)  # the draft's own folder, no placeholder
    assert make_plan(model("llama-3.1-8b"), gpu, Targets(draft_model_bytes=750_000_000)).speculative.method == "none"


def test_tensor_and_decode_context_parallel_flags():
    p = make_plan(model("qwen3.6-27b"), find_profile("H100"), Targets(context=131_072), Platform(gpu_count=8))
    args = list(p.vllm_args)
    assert args[args.index("--tensor-parallel-size") + 1] == "8"
    assert args[args.index("--decode-context-parallel-size") + 1] == "2"  # 8 ranks / 4 KV heads


def test_cpu_backend_plan_matches_the_engines_arithmetic():
    # SmolLM2-135M shape: 30 layers, 3 KV heads x 64; the CPU engine logged 46,592 tokens, 22.75x for 1 GiB.
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576, "head_dim": 64, "max_position_embeddings": 8192,
           "vocab_size": 49152, "torch_dtype": "bfloat16"}
    p = make_plan(shape_from_config(cfg), None, Targets(context=2048), Platform("cpu", cpu_isa="avx2"), kv_pool_bytes=GiB)
    assert p.layout.block_size == 128
    assert p.capacity.tokens_reported == 46_592 and round(p.capacity.max_concurrency, 2) == 22.75


def test_bad_planning_input():
    m = model("llama-3.1-8b")
    with pytest.raises(UnknownGpu, match="known: RTX PRO 6000 Blackwell"):
        find_profile("Voodoo 2")
    with pytest.raises(ValueError, match="positive"):
        custom_profile(0)
    with pytest.raises(PlanError, match="sessions must be positive"):
        make_plan(m, find_profile("L4"), Targets(sessions=0))
    with pytest.raises(PlanError, match="CPU backend has no GPU memory"):
        make_plan(m, None, Targets(), Platform("cpu", cpu_isa="avx2"))
    with pytest.raises(PlanError, match="depends on the host's instruction set"):
        make_plan(m, None, Targets(), Platform("cpu"), kv_pool_bytes=GiB)
    with pytest.raises(PlanError, match="KV pool must be positive"):
        make_plan(m, find_profile("L4"), Targets(), kv_pool_bytes=-1)


def test_nvml_names_resolve_to_profiles():
    assert find_profile("NVIDIA RTX PRO 6000 Blackwell Workstation Edition").name == "RTX PRO 6000 Blackwell"
    assert find_profile("NVIDIA H100 80GB HBM3").name == "H100 80GB"
    assert find_profile("rtx-pro-6000-blackwell").name == "RTX PRO 6000 Blackwell"
