"""The kvbudget model against vLLM itself, for every fixture family, KV dtype, prefix-caching setting and
device: four GPU cards and the CPU backend on each of the four host instruction-set levels.

vLLM's figures come from kvbudget/vllm_probe.py: vLLM parses the plan's own command line, builds the model
on the meta device, lets every layer report its KV cache spec, applies its block-size rules for the
backend it picks on that device (an emulated CUDA platform answering for the card's compute capability; the
CPU platform given PyTorch's answers for an AVX2, AVX-512, AVX-512 BF16 or AMX host) and sizes the pool
with its own allocator. Nothing kvbudget computed is handed to vLLM except the command line, so a misread
config.json, or a host rule kvbudget.cpu gets wrong, shows up as a difference here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvbudget import probe
from kvbudget.cpu import CPU_ISAS, cpu_flags, host_isa, isa_from_flags
from kvbudget.model_files import read_model
from kvbudget.plan_types import Plan, PlanError, Platform, Targets
from kvbudget.planner import make_plan
from kvbudget.profiles import find_profile

pytestmark = pytest.mark.vllm

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "models"
MODELS = sorted(p.stem for p in FIX.glob("*.json") if p.stem != "not-a-causal-lm")
GPU_CARDS = ("H100 80GB", "L40S", "A100 80GB", "RTX PRO 6000 Blackwell")
CPUS = tuple(f"CPU {isa}" for isa in CPU_ISAS)
DEVICES = GPU_CARDS + CPUS
POOL = 16 << 30
# vLLM's spec classes by the kvbudget kind that models them.
SPEC_KIND = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "ChunkedLocalAttentionSpec": "chunked",
             "MLAAttentionSpec": "mla", "MambaSpec": "state"}
# Checkpoints whose weights vLLM's CPU build cannot run at a level, with vLLM's words: the planner refuses
# them before vLLM is asked, and vLLM, asked anyway, must refuse with these words.
_NO_AMX = {
    "gpt-oss-20b": "No MXFP4 MoE backend supports",  # MXFP4 MoE kernels need AMX on the CPU
    "qwen3.6-27b-fp8": "requires AMX tile support",  # block-FP8 weights on the CPU need AMX tiles
    "llama-3.1-8b-instruct-nvfp4": "NVFP4 linear layer",  # no NVFP4 weight kernel on the CPU
}
CPU_REFUSES = {
    "avx2": _NO_AMX,
    "avx512": _NO_AMX,
    "avx512-bf16": _NO_AMX,
    "amx": {"llama-3.1-8b-instruct-nvfp4": "NVFP4 linear layer"},
}
FP8_KV_REFUSED = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"  # vLLM's words (cpu_attn.py)


def _isa(device: str) -> str:
    return device.split(" ", 1)[1]


def _plan(name: str, device: str, kv: str, prefix: bool, *, weights_checked: bool = True) -> Plan | PlanError:
    model = read_model(FIX / f"{name}.json")
    if not weights_checked:  # the command line the planner would give if it did not know the weight kernels
        model = replace(model, weight_format="")
    context = min(32_768, model.max_position_embeddings or 32_768)
    targets = Targets(context=context, kv_dtype=kv, prefix_caching=prefix)
    try:
        if device in CPUS:
            return make_plan(model, None, targets, Platform("cpu", cpu_isa=_isa(device)), kv_pool_bytes=POOL)
        return make_plan(model, find_profile(device), targets, Platform("gpu"), kv_pool_bytes=POOL)
    except PlanError as e:
        return e  # FP8 KV on a card without FP8, or weights the CPU cannot run: refused before vLLM is asked


def _cases(device: str) -> list[tuple[str, str, bool]]:
    dtypes = ("auto", "fp8") if device in CPUS else ("bf16", "fp8")
    return [(m, kv, prefix) for m in MODELS for kv in dtypes for prefix in (True, False)]


@dataclass(frozen=True)
class Answer:
    plan: Plan | PlanError
    vllm: object  # VllmFigures, or vLLM's refusal of the plan's command line (or of the refused plan's)
    fp8_asked: object = None  # vLLM's answer to the plan with FP8 KV forced, where the planner fell back


def _device(device: str) -> probe.Device:
    if device in CPUS:
        return probe.cpu_host(_isa(device))
    card = find_profile(device)
    return probe.Device("cuda", card.compute_capability, device, card.memory_bytes)


def _question(name: str, plan: Plan, extra: tuple[str, ...] = ()) -> probe.Question:
    return probe.Question(FIX / f"{name}.json", plan.vllm_args + extra,
                          tuple(c for c in plan.sessions_at if c != plan.engine.max_model_len))


@pytest.fixture(scope="session")
def vllm_answers(request) -> dict[tuple[str, str, str, bool], Answer]:
    """One probe process per device answers every combination (vLLM is imported once per device); the
    devices' processes run side by side, one per core. Only the devices of the selected tests are asked
    (`-k "CPU amx"` asks one)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def ask_device(device: str) -> list[tuple[tuple, Answer]]:
        keys, questions, fallbacks = [], [], []
        for case in _cases(device):
            plan = _plan(case[0], device, *case[1:])
            if isinstance(plan, PlanError):
                if device not in CPUS:
                    keys.append((case, plan, None))
                    continue
                asked = _plan(case[0], device, *case[1:], weights_checked=False)
                assert isinstance(asked, Plan), asked
                questions.append(_question(case[0], asked))
            else:
                questions.append(_question(case[0], plan))
            fp8_fallback = device in CPUS and case[1] == "fp8" and isinstance(plan, Plan) \
                and plan.engine.kv_dtype != "fp8"
            keys.append((case, plan, len(fallbacks) if fp8_fallback else None))
            if fp8_fallback:
                fallbacks.append(_question(case[0], plan, ("--kv-cache-dtype", "fp8")))
        answers = iter(probe.ask_many(questions + fallbacks, _device(device)))
        asked = [next(answers) if not (isinstance(p, PlanError) and device not in CPUS) else None
                 for _, p, _ in keys]
        forced = list(answers)
        return [((device, *case), Answer(p, a, forced[f] if f is not None else None))
                for (case, p, f), a in zip(keys, asked, strict=True)]

    wanted = [d for d in DEVICES if any(item.callspec.params["case"][0] == d for item in request.session.items
                                        if "case" in getattr(getattr(item, "callspec", None), "params", {}))]
    with ThreadPoolExecutor(max_workers=max(1, min(len(wanted), os.cpu_count() or 1))) as pool:
        return {key: value for answers in pool.map(ask_device, wanted) for key, value in answers}


def _ids(case: tuple) -> str:
    return f"{case[0]}-{case[1]}-{case[2]}-prefix-{'on' if case[3] else 'off'}"


ALL = [(device, *case) for device in DEVICES for case in _cases(device)]


def _figures_agree(plan: Plan, vllm: probe.VllmFigures) -> None:
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
        "kv_dtype": "fp8" if plan.engine.kv_dtype == "fp8" else "auto",
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
        "kv_dtype": "fp8" if vllm.kv_cache_dtype.startswith("fp8") else "auto",
    }
    assert ours == theirs, f"{vllm.platform}, backends {vllm.attention_backends}"
    if plan.model.state_layers:
        assert vllm.mamba_cache_mode == ("align" if plan.targets.prefix_caching else "none")
        (state,) = {g.state_bytes for g in vllm.groups if g.type == "MambaSpec"}
        assert state == lay.mamba_page_real


@pytest.mark.parametrize("case", ALL, ids=[_ids(c) for c in ALL])
def test_kvbudget_equals_vllm(vllm_answers, case):
    device, name, kv, _prefix = case
    answer = vllm_answers[case]
    if device in CPUS:
        isa = _isa(device)
        refused_words = CPU_REFUSES[isa].get(name)
        if refused_words:
            assert isinstance(answer.plan, PlanError), f"the planner should refuse {name}'s weights on {isa}"
            assert isinstance(answer.vllm, probe.VllmRefused) and refused_words in str(answer.vllm), answer.vllm
            return
        assert isinstance(answer.plan, Plan), f"the planner refused what vLLM builds on {isa}: {answer.plan}"
        if answer.fp8_asked is not None:  # the planner fell back from FP8 KV: vLLM's reason, in its words
            if answer.plan.model.mla_latent_dim:
                assert isinstance(answer.vllm, probe.VllmFigures)
                assert not any("fp8" in d for b in answer.vllm.attention_backends
                               for d in answer.vllm.backend_kv_dtypes[b]), answer.vllm.backend_kv_dtypes
            else:
                assert isinstance(answer.fp8_asked, probe.VllmRefused), answer.fp8_asked
                assert FP8_KV_REFUSED in str(answer.fp8_asked)
        assert isinstance(answer.vllm, probe.VllmFigures), f"vLLM did not answer: {answer.vllm}"
        assert answer.vllm.cpu_isa == isa
        _figures_agree(answer.plan, answer.vllm)
        return
    if isinstance(answer.plan, PlanError):
        assert device == "A100 80GB" and kv == "fp8", "only FP8 KV on a card without FP8 is refused before vLLM"
        return
    assert isinstance(answer.vllm, probe.VllmFigures), f"vLLM did not answer: {answer.vllm}"
    _figures_agree(answer.plan, answer.vllm)


def test_this_host_unemulated():
    """The planner's reading of this host against vLLM's own, with nothing emulated: the level read off
    /proc/cpuinfo is the one PyTorch reports to vLLM in the engine's interpreter, and the plans for an MLA
    model (whose backend and block size follow AMX) and for FP8 KV (which follows AVX-512) are what vLLM
    allocates here, or vLLM refuses them for the reason the plan gives."""
    isa = host_isa()
    platform = Platform("cpu", cpu_isa=isa)
    mla = make_plan(read_model(FIX / "deepseek-v2-lite-chat.json"), None, Targets(context=32_768), platform,
                    kv_pool_bytes=POOL)
    fp8 = make_plan(read_model(FIX / "smollm2-135m-instruct.json"), None, Targets(context=4096, kv_dtype="fp8"),
                    platform, kv_pool_bytes=POOL)
    forced = fp8.vllm_args if fp8.engine.kv_dtype == "fp8" else (*fp8.vllm_args, "--kv-cache-dtype", "fp8")
    answers = probe.ask_many([_question("deepseek-v2-lite-chat", mla), _question("smollm2-135m-instruct", fp8),
                              probe.Question(FIX / "smollm2-135m-instruct.json", forced)], probe.THIS_MACHINE)
    mla_vllm, fp8_vllm, forced_vllm = answers
    assert isinstance(mla_vllm, probe.VllmFigures) and mla_vllm.cpu_isa == isa, (isa, mla_vllm)
    assert mla_vllm.attention_backends == (("AMX_MLA",) if isa == "amx" else ("CPU_MLA",))
    _figures_agree(mla, mla_vllm)
    assert isinstance(fp8_vllm, probe.VllmFigures)
    _figures_agree(fp8, fp8_vllm)
    if isa in ("avx512", "avx512-bf16", "amx"):
        assert fp8.engine.kv_dtype == "fp8" and fp8_vllm.kv_cache_dtype.startswith("fp8")
    else:
        assert fp8.engine.kv_dtype == "auto" and "AVX-512 or AMX" in " ".join(fp8.notes)
        assert isinstance(forced_vllm, probe.VllmRefused) and FP8_KV_REFUSED in str(forced_vllm)


def test_host_reading_agrees_with_torch():
    """kvbudget.cpu reads /proc/cpuinfo by PyTorch's definitions; PyTorch itself says the same here
    (the real host's flags, whatever KVBUDGET_HOST_CPU_ISA makes the planner assume)."""
    import torch

    answers = {"avx512": torch.cpu._is_avx512_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
               "amx_tile": torch.cpu._is_amx_tile_supported()}
    if answers["amx_tile"]:
        from_torch = "amx"
    elif answers["avx512"]:
        from_torch = "avx512-bf16" if answers["avx512_bf16"] else "avx512"
    else:
        from_torch = "avx2"
    assert isa_from_flags(cpu_flags()) == from_torch, answers


def test_vllm_refusal_becomes_the_plans(tmp_path):
    """A context beyond max_position_embeddings: vLLM refuses, and the plan refuses with vLLM's words."""
    from appliance.boot.planning import with_vllm_figures

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
    from appliance.boot.planning import with_draft

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
    for (key, plan), vllm in zip(plans.items(), answers, strict=True):
        assert isinstance(vllm, probe.VllmFigures), f"{key}: {vllm}"
        assert (vllm.num_blocks, vllm.blocks_per_request, vllm.block_size) == (
            plan.capacity.num_blocks, plan.capacity.blocks_per_request, plan.layout.block_size), key
        assert vllm.kv_layers == sum(g.layers for g in plan.layout.groups), key
    assert answers[0].kv_layers == 33  # 32 target layers + the EAGLE-3 head's one


def test_fp8_weights_are_vllms_to_accept_or_refuse():
    """The BF16 anchor model on an L40S, planned with --quantization fp8: vLLM takes the command line on the
    card (and sizes the pool as the plan does); on a card below vLLM's minimum for FP8 weights it refuses with
    its own words, and the minimum it names is the one kvbudget refuses at."""
    from appliance.boot.planning import with_vllm_figures
    from kvbudget import weights
    from kvbudget.profiles import custom_profile

    l40s, path = find_profile("L40S"), FIX / "qwen3.6-27b.json"
    plan = make_plan(read_model(path), l40s, Targets(context=32_768), Platform("gpu"))
    assert plan.weights.scheme == "fp8" and "--quantization" in plan.vllm_args
    checked = with_vllm_figures(plan, path, probe.Device("cuda", l40s.compute_capability, l40s.name,
                                                         l40s.memory_bytes), None)
    assert checked.source.startswith("vllm ") and checked.vllm.num_blocks == plan.capacity.num_blocks
    volta = probe.Device("cuda", (7, 0), "V100", 32 << 30)
    with pytest.raises(PlanError, match=r"quantization method fp8 is not supported for the current GPU\. Minimum "
                                        r"capability: 75") as refused:
        with_vllm_figures(plan, path, volta, None)
    assert "Minimum capability: %d%d" % weights.FP8_MIN_CAPABILITY in str(refused.value)
    with pytest.raises(PlanError, match="Minimum capability: 75"):
        make_plan(read_model(path), custom_profile(l40s.memory_bytes, (7, 0), "V100"), Targets(weights="fp8"))


def test_unmodelled_configs_follow_vllm_with_every_disagreement_named():
    """Configs whose cache-holding layers the kvbudget model does not read (refused model-only, see
    tests/unit/kvbudget/test_unmodelled.py): asked, vLLM answers, the plan takes vLLM's figures and lists what
    the model did not read first, then each difference. The model alone would have been several times off."""
    from appliance.boot.planning import with_vllm_figures

    unmodelled = FIX.parent / "unmodelled"
    for name, off_by in (("jamba-tiny", 5.0), ("gemma3n-tiny", 2.0)):
        path = unmodelled / f"{name}.json"
        # the model dtype's KV on every host (FP8 KV, where the host has it, changes the ratio, not the point)
        model_only = make_plan(read_model(path), None, Targets(context=4096, kv_dtype="bf16"),
                               Platform("cpu", cpu_isa=host_isa()), kv_pool_bytes=1 << 30)
        plan = with_vllm_figures(model_only, path, probe.THIS_MACHINE, None)
        assert plan.source.startswith("vllm ") and plan.vllm is not None
        assert plan.capacity.max_concurrency == plan.vllm.max_concurrency
        assert plan.disagreements[0].startswith("the kvbudget model does not read ")
        assert all(item in plan.disagreements[0] for item in model_only.model.unmodelled)
        assert any(d.startswith("max concurrency:") for d in plan.disagreements)
        assert plan.vllm.max_concurrency > off_by * model_only.capacity.max_concurrency, (name, plan.disagreements)


_AS_AVX2_HOST = """# The probe as it runs on an AVX2 host: torch reports no AVX-512 before vLLM loads its kernels, so the
# AVX2 build (vllm._C_AVX2) is the one loaded, and every level above it is emulated on top of that build.
import runpy, sys, torch
for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
    setattr(torch.cpu, name, lambda: False)
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
ON_AVX2 = ("deepseek-v2-lite-chat", "gpt-oss-20b", "qwen3.6-27b-fp8", "granite-4.0-h-tiny", "smollm2-135m-instruct",
           "qwen3.5-9b")


def test_the_probe_emulates_each_level_alike_from_an_avx2_host(tmp_path: Path):
    """An AVX2 host loads vLLM's AVX2 kernel build, which lacks the ops the BF16 build has; the emulation
    gives vLLM the emulated build's answers, so the levels above AVX2 plan as on their own hosts (here
    for the checkpoints and layer kinds whose answers depend on the build)."""
    import json
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    wrapper = tmp_path / "as_avx2_host.py"
    wrapper.write_text(_AS_AVX2_HOST)

    def ask(isa: str) -> list[tuple[str, Plan | PlanError, dict]]:
        device = f"CPU {isa}"
        cases = [(name, _plan(name, device, "fp8" if name == "smollm2-135m-instruct" else "auto", True))
                 for name in ON_AVX2]
        asked = [p if isinstance(p, Plan) else _plan(name, device, "auto", True, weights_checked=False)
                 for name, p in cases]
        job = {"device": {"platform": "cpu", "isa": isa},
               "requests": [{"model": str(FIX / f"{name}.json"), "args": list(p.vllm_args),
                             "contexts": list(_question(name, p).contexts)} for (name, _), p in zip(cases, asked,
                                                                                                   strict=True)]}
        done = subprocess.run([sys.executable, str(wrapper), str(probe.PROBE_SCRIPT)], input=json.dumps(job),
                              capture_output=True, text=True, timeout=300)
        answers = json.loads(done.stdout)["answers"]
        assert all("emulated on this avx2 host" in " ".join(a.get("notes", [])) for a in answers), answers[0]
        return [(name, p, a) for (name, p), a in zip(cases, answers, strict=True)]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(("avx512", "amx"), pool.map(ask, ("avx512", "amx")), strict=True))
    for isa, answered in results.items():
        for name, plan, raw in answered:
            try:
                vllm = probe._figures(raw)
            except probe.VllmRefused as e:
                vllm = e
            words = CPU_REFUSES[isa].get(name)
            if words:
                assert isinstance(plan, PlanError) and isinstance(vllm, probe.VllmRefused), (isa, name, vllm)
                assert words in str(vllm), (isa, name, vllm)
                continue
            assert isinstance(plan, Plan) and isinstance(vllm, probe.VllmFigures), (isa, name, vllm)
            _figures_agree(plan, vllm)


def test_the_probe_knows_the_kernel_builds_this_host_can_load():
    """kvbudget/vllm_probe.py's table of what vllm._custom_ops records about each kernel build, against the
    builds themselves: each build this host can run is loaded in its own interpreter and asked."""
    import importlib.util
    import json
    import subprocess
    import sys

    spec = importlib.util.spec_from_file_location("vllm_probe_table", probe.PROBE_SCRIPT)
    assert spec is not None and spec.loader is not None
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    loadable = {"avx2": ["_C_AVX2"], "avx512": ["_C_AVX2", "_C_AVX512"], "avx512-bf16": ["_C_AVX2", "_C_AVX512", "_C"],
                "amx": ["_C_AVX2", "_C_AVX512", "_C"]}[isa_from_flags(cpu_flags())]
    script = """
import importlib, json, sys
try:
    importlib.import_module("vllm." + sys.argv[1])
except ImportError as e:
    if "dynamic module does not define" not in str(e):
        raise
import vllm.platforms as platforms
type(platforms.current_platform).import_kernels = classmethod(lambda cls: None)  # that build, no other
import vllm._custom_ops as ops
print(json.dumps({k: v for k, v in vars(ops).items() if k.startswith("_supports") and isinstance(v, bool)}))
"""
    for build in loadable:
        done = subprocess.run([sys.executable, "-c", script, build], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == table.BUILD_OPS[build], build
    assert set(table.LEVEL_BUILD.values()) == set(table.BUILD_OPS)
