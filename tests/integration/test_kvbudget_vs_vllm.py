"""The kvbudget model against vLLM itself, for every fixture family, KV dtype, prefix-caching setting and card.

vLLM's figures come from kvbudget/vllm_probe.py: vLLM parses the plan's own command line, builds the model
on the meta device, lets every layer report its KV cache spec, applies its block-size rules for the
backend it picks on that card (an emulated CUDA platform answering for the card's compute capability; the
CPU platform for this machine) and sizes the pool with its own allocator. Nothing kvbudget computed is handed
to vLLM except the command line, so a misread config.json shows up as a difference here.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvbudget import probe
from kvbudget.model_files import read_model
from kvbudget.plan_types import Plan, PlanError, Platform, Targets
from kvbudget.planner import make_plan
from kvbudget.profiles import find_profile

pytestmark = pytest.mark.vllm

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "models"
MODELS = sorted(p.stem for p in FIX.glob("*.json") if p.stem != "not-a-causal-lm")
CARDS = ("H100 80GB", "L40S", "A100 80GB", "RTX PRO 6000 Blackwell", "CPU")
POOL = 16 << 30
# vLLM's spec classes by the kvbudget kind that models them.
SPEC_KIND = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "ChunkedLocalAttentionSpec": "chunked",
             "MLAAttentionSpec": "mla", "MambaSpec": "state"}
# Combinations vLLM itself cannot build on this CPU (the probe reports vLLM's reason; the test checks it).
CPU_REFUSES = {
    "gpt-oss-20b": "No MXFP4 MoE backend supports",  # MXFP4 MoE kernels are GPU-only
    "qwen3.6-27b-fp8": "requires AMX",  # block-FP8 weights on the CPU need AMX tiles
    "llama-3.1-8b-instruct-nvfp4": "NVFP4 linear layer",  # no NVFP4 weight kernel on the CPU
}


def _plan(name: str, card: str, kv: str, prefix: bool) -> Plan | None:
    model = read_model(FIX / f"{name}.json")
    context = min(32_768, model.max_position_embeddings or 32_768)
    targets = Targets(context=context, kv_dtype=kv, prefix_caching=prefix)
    if card == "CPU":
        return make_plan(model, None, targets, Platform("cpu"), kv_pool_bytes=POOL)
    try:
        return make_plan(model, find_profile(card), targets, Platform("gpu"), kv_pool_bytes=POOL)
    except PlanError:
        return None  # FP8 KV on a card without FP8: the planner refuses before vLLM is asked


def _cases(card: str) -> list[tuple[str, str, bool]]:
    dtypes = ("auto",) if card == "CPU" else ("bf16", "fp8")
    return [(m, kv, prefix) for m in MODELS for kv in dtypes for prefix in (True, False)]


@pytest.fixture(scope="session")
def vllm_answers() -> dict[tuple[str, str, str, bool], tuple[Plan, object]]:
    """One probe process per card answers every combination (vLLM is imported once per card); the cards'
    processes run side by side, one per core."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def ask_card(card: str) -> list[tuple[tuple, tuple[Plan, object]]]:
        planned = [(case, p) for case in _cases(card) if (p := _plan(case[0], card, *case[1:])) is not None]
        device = probe.THIS_MACHINE if card == "CPU" else probe.Device(
            "cuda", find_profile(card).compute_capability, card, find_profile(card).memory_bytes)
        questions = [probe.Question(FIX / f"{case[0]}.json", p.vllm_args,
                                    tuple(c for c in p.sessions_at if c != p.engine.max_model_len))
                     for case, p in planned]
        return [((card, *case), (p, a)) for (case, p), a in zip(planned, probe.ask_many(questions, device))]

    with ThreadPoolExecutor(max_workers=max(1, min(len(CARDS), os.cpu_count() or 1))) as pool:
        return {key: value for answers in pool.map(ask_card, CARDS) for key, value in answers}


def _ids(case: tuple) -> str:
    return f"{case[0]}-{case[1]}-{case[2]}-prefix-{'on' if case[3] else 'off'}"


ALL = [(card, *case) for card in CARDS for case in _cases(card)]


@pytest.mark.parametrize("case", ALL, ids=[_ids(c) for c in ALL])
def test_kvbudget_equals_vllm(vllm_answers, case):
    card, name, kv, prefix = case
    if case not in vllm_answers:
        assert card == "A100 80GB" and kv == "fp8", "only FP8 KV on a card without FP8 is refused before vLLM"
        return
    plan, vllm = vllm_answers[case]
    if card == "CPU" and name in CPU_REFUSES:
        assert isinstance(vllm, probe.VllmRefused) and CPU_REFUSES[name] in str(vllm)
        return
    assert isinstance(vllm, probe.VllmFigures), f"vLLM did not answer: {vllm}"
    lay, cap = plan.layout, plan.capacity
    assert lay is not None and cap is not None
    ours = {
        "block_size": lay.block_size,
        "page_bytes": lay.page_bytes,
        "groups": Counter(("state" if g.kind in ("linear", "mamba") else g.kind, g.layers) for g in lay.groups),
        "num_blocks": cap.num_blocks,
        "blocks_per_request": cap.blocks_per_request,
        "max_concurrency": round(cap.max_concurrency, 9),
        "kv_tokens": cap.tokens_reported,
        "sessions_at": {c: round(n, 9) for c, n in plan.sessions_at.items() if c != plan.engine.max_model_len},
        "prefix_caching": plan.targets.prefix_caching,
    }
    theirs = {
        "block_size": vllm.block_size,
        "page_bytes": vllm.page_bytes,
        "groups": Counter({(SPEC_KIND[g.type], g.layers): g.groups for g in vllm.groups}),
        "num_blocks": vllm.num_blocks,
        "blocks_per_request": vllm.blocks_per_request,
        "max_concurrency": round(vllm.max_concurrency, 9),
        "kv_tokens": vllm.kv_tokens,
        "sessions_at": {c: round(n, 9) for c, n in vllm.sessions_at.items()},
        "prefix_caching": vllm.enable_prefix_caching,
    }
    assert ours == theirs, f"{vllm.platform}, backends {vllm.attention_backends}"
    if plan.model.state_layers:
        assert vllm.mamba_cache_mode == ("align" if prefix else "none")
        (state,) = {g.state_bytes for g in vllm.groups if g.type == "MambaSpec"}
        assert state == lay.mamba_page_real


def test_vllm_refusal_becomes_the_plans(tmp_path):
    """A context beyond max_position_embeddings: vLLM refuses, and the plan refuses with vLLM's words."""
    from appliance.planning import with_vllm_figures

    model = read_model(FIX / "gemma-2b.json")  # max_position_embeddings 8192
    plan = make_plan(model, find_profile("L40S"), Targets(context=16_384), Platform("gpu"))
    device = probe.Device("cuda", (8, 9), "L40S", find_profile("L40S").memory_bytes)
    with pytest.raises(PlanError, match="greater than the derived max_model_len"):
        with_vllm_figures(plan, FIX / "gemma-2b.json", device, None)


def test_vllm_parser_refuses_a_bad_flag():
    with pytest.raises(probe.VllmRefused, match="argument parser refused"):
        probe.ask(FIX / "llama-3.1-8b.json", ["--kv-cache-memory-bytes", "1073741824", "--no-such-flag"])


def _eagle3_draft(folder: Path) -> Path:
    """An EAGLE-3 head for Llama-3.1-8B as published (config.json), with a header-only safetensors file
    naming its tensors: the planner reads bytes from the header, the probe never loads weights."""
    import json
    import struct

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
        "vocab_size": 128256}))
    shapes = {"fc.weight": [4096, 12288], "midlayer.self_attn.q_proj.weight": [4096, 8192],
              "midlayer.self_attn.k_proj.weight": [1024, 8192], "midlayer.self_attn.v_proj.weight": [1024, 8192],
              "midlayer.self_attn.o_proj.weight": [4096, 4096], "midlayer.mlp.gate_proj.weight": [14336, 4096],
              "midlayer.mlp.up_proj.weight": [14336, 4096], "midlayer.mlp.down_proj.weight": [4096, 14336],
              "lm_head.weight": [32000, 4096]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + shape[0] * shape[1] * 2]}
        offset += shape[0] * shape[1] * 2
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


def test_eagle3_draft_tensor_and_decode_context_parallel_agree_with_vllm(tmp_path):
    """The draft's own folder in --speculative-config, its layers in the pool; TP and DCP as vLLM checks them."""
    from appliance.planning import with_draft

    h100 = find_profile("H100 80GB")
    draft = with_draft(Targets(context=32_768), _eagle3_draft(tmp_path / "eagle3"))
    plans = {
        "eagle3": make_plan(read_model(FIX / "llama-3.1-8b.json"), h100, draft, Platform("gpu")),
        "tp2": make_plan(read_model(FIX / "qwen3-8b.json"), h100, Targets(context=32_768), Platform("gpu", gpu_count=2)),
        "tp16-dcp2": make_plan(read_model(FIX / "llama-3.1-8b.json"), h100, Targets(context=32_768),
                               Platform("gpu", gpu_count=16)),
        "hybrid-tp8-dcp2": make_plan(read_model(FIX / "qwen3.6-27b.json"), h100, Targets(context=32_768),
                                     Platform("gpu", gpu_count=8)),
    }
    eagle_args = " ".join(plans["eagle3"].vllm_args)
    assert f'"model":"{tmp_path / "eagle3"}"' in eagle_args and "<" not in eagle_args
    assert plans["eagle3"].memory.draft_weights == draft.draft_model_bytes > 0
    assert "--decode-context-parallel-size" in plans["tp16-dcp2"].vllm_args
    models = {"eagle3": "llama-3.1-8b", "tp2": "qwen3-8b", "tp16-dcp2": "llama-3.1-8b", "hybrid-tp8-dcp2": "qwen3.6-27b"}
    answers = probe.ask_many([probe.Question(FIX / f"{models[k]}.json", p.vllm_args) for k, p in plans.items()],
                             probe.Device("cuda", h100.compute_capability, h100.name, h100.memory_bytes))
    for (key, plan), vllm in zip(plans.items(), answers):
        assert isinstance(vllm, probe.VllmFigures), f"{key}: {vllm}"
        assert (vllm.num_blocks, vllm.blocks_per_request, vllm.block_size) == (
            plan.capacity.num_blocks, plan.capacity.blocks_per_request, plan.layout.block_size), key
        assert vllm.kv_layers == sum(g.layers for g in plan.layout.groups), key
    assert answers[0].kv_layers == 33  # 32 target layers + the EAGLE-3 head's one
