"""From a GPU, a model and a site's targets to a plan: memory breakdown, KV capacity, vLLM arguments.

Pure: values in, a Plan out. Discovery (NVML, files) happens before, rendering after.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from kvbudget import cpu, weights
from kvbudget.accounting import (
    EngineShape,
    KvCapacity,
    KvDtype,
    KvLayout,
    capacity,
    cdiv,
    layout,
    pool_for_sessions,
)
from kvbudget.model import STATE_KINDS, ModelShape
from kvbudget.plan_types import (
    Finding,
    Memory,
    Plan,
    PlanError,
    Platform,
    Speculative,
    Targets,
)
from kvbudget.probe import VllmFigures
from kvbudget.profiles import PROFILES, GpuProfile
from kvbudget.tools import plan_tools
from kvbudget.weights import WeightChoice

GiB = 1 << 30

DEFAULT_CONTEXT = {"chat": 32_768, "code": 32_768, "long-context": 131_072, "tool-calling": 32_768}
SESSION_CONTEXTS = (4_096, 8_192, 32_768, 131_072)
CUDA_CONTEXT_BYTES = 768 << 20  # CUDA context, cuBLAS/NCCL workspaces: measured 0.5-1 GiB on recent drivers
CUDA_GRAPH_BYTES = 512 << 20  # vLLM's CUDA-graph pool for the default capture sizes (an estimate)



# -- the pieces -----------------------------------------------------------------------------


def choose_kv_dtype(targets: Targets, gpu: GpuProfile, platform: Platform,
                    model: ModelShape) -> tuple[KvDtype, str | None]:
    want = targets.kv_dtype
    if platform.kind == "cpu":
        if want not in ("auto", "fp8", "fp4"):
            return "auto", None  # the model's own dtype (vLLM's "auto")
        refusal = cpu.kv_dtype_refusal("fp8" if want == "auto" else want, model.head_dim,
                                       bool(model.mla_latent_dim), platform.isa)
        if refusal:
            return "auto", f"{refusal}; KV stays in the model dtype"
        if want == "auto":
            # vLLM's CPU attention takes FP8 KV from AVX-512 on: twice the tokens in the same pool, and on
            # the embedded default no loss on its eval set (bench/RESULTS.md, bench/quantized.py).
            return "fp8", (f"FP8 KV cache on this {platform.isa} host (vLLM's CPU attention takes it from AVX-512 "
                           "on): twice the tokens of the model dtype in the same pool; targets.kv_dtype = \"bf16\" "
                           "keeps the model dtype")
        return want, None
    if want == "auto":
        return ("fp8", None) if gpu.fp8 else ("auto", f"{gpu.name} has no FP8 (compute capability below 8.9): KV stays in the model dtype")
    if want == "fp8" and not gpu.fp8:
        raise PlanError(f"FP8 KV cache needs compute capability 8.9 or newer; {gpu.name} is {gpu.compute_capability[0]}.{gpu.compute_capability[1]}")
    if want == "fp4" and not gpu.fp4:
        raise PlanError(f"FP4 KV cache needs a Blackwell GPU (compute capability 10.0 or newer); {gpu.name} is not")
    return want, None


def choose_speculative(model: ModelShape, targets: Targets, platform: Platform, memory_tight: bool) -> Speculative:
    """The speculative-decoding table of docs/background.md, with the engine hazards from docs/engine-notes.md."""
    k = targets.num_speculative_tokens
    gdn = model.is_hybrid_linear
    if targets.speculative == "off":
        return Speculative("none", 0, "turned off in the configuration (targets.speculative = \"off\")")
    if targets.workload == "tool-calling":
        return Speculative("none", 0, "heavy tool calling: constrained decoding collapses the acceptance rate")
    if model.mtp_layers:
        return Speculative("mtp", k or min(3, max(1, model.mtp_layers * 2)),
                           "the model ships native MTP heads (acceptance above 80% without a separate draft)")
    if targets.draft_model and targets.workload in ("chat", "long-context") and platform.kind == "gpu":
        return Speculative("eagle3", k or 3, "EAGLE-3 draft provided: best acceptance per cost for dense chat",
                           targets.draft_model)
    if targets.workload == "code" or memory_tight:
        if gdn:
            return Speculative("none", 0, "n-gram speculation corrupts output on Gated DeltaNet hybrids "
                                          "(vLLM issue 39273); no MTP heads or EAGLE draft available")
        why = "code: repetitive structure gives n-gram a high hit rate" if targets.workload == "code" \
            else "strict memory budget: n-gram needs no draft model"
        return Speculative("ngram", k or 3, why)
    return Speculative("none", 0, "no draft model given (EAGLE-3/3.1 is the recommendation for "
                                  f"{targets.workload}: give its local folder, targets.draft_model or --draft-model)")


def draft_layers(spec: Speculative, model: ModelShape, targets: Targets) -> int:
    if spec.method == "eagle3":
        return targets.draft_layers if targets.draft_layers is not None else 1
    if spec.method == "mtp":
        return max(1, model.mtp_layers)
    return 0


def attention_block_size(model: ModelShape, gpu: GpuProfile, platform: Platform, kv_dtype: KvDtype) -> int:
    """The block size vLLM's attention backend asks for (Platform.update_block_size_for_backend, before any
    hybrid alignment). Mirrors which backend vLLM picks; the vLLM probe checks it against vLLM's own choice."""
    if model.mla_latent_dim:
        if platform.kind == "cpu":
            return cpu.mla_block_size(platform.isa)  # AMX_MLA 128, the reference CPU_MLA exactly 16
        if kv_dtype == "fp8" and gpu.compute_capability[0] == 9:
            return 64  # FlashMLA, vLLM's first choice for an FP8 latent cache on Hopper
        return 16
    return platform.block_size


def reserve_bytes(model: ModelShape, targets: Targets, platform: Platform, tp: int) -> int:
    """Activation peak of a max_num_batched_tokens forward pass, the CUDA context and graphs.

    An estimate: vLLM measures this by profiling (tens of seconds, known to mis-size). The plan
    passes an explicit KV size, so an error here lands in the headroom, not in an OOM.
    """
    if platform.kind == "cpu":
        return 0
    inter = model.moe_intermediate_size or model.intermediate_size or 4 * model.hidden_size
    per_token = (4 * model.hidden_size + 2 * int(inter)) * 2 // tp
    logits = 256 * model.vocab_size * 4  # sampled rows of fp32 logits
    activation = platform.batched_tokens(targets) * per_token + logits
    graphs = 0 if platform.enforce_eager else CUDA_GRAPH_BYTES
    return CUDA_CONTEXT_BYTES + activation + graphs


def parallelism(model: ModelShape, platform: Platform) -> tuple[int, int, list[str]]:
    """Tensor parallel over every GPU, and decode context parallel where TP exceeds the KV heads."""
    notes = []
    tp = platform.gpu_count
    if tp > 1 and model.num_attention_heads % tp:
        raise PlanError(f"{model.num_attention_heads} attention heads do not split over {tp} GPUs")
    dcp = 1
    if tp > model.num_kv_heads and platform.kind == "gpu":
        dcp = tp // model.num_kv_heads
        notes.append(f"decode context parallel {dcp}: TP {tp} exceeds the {model.num_kv_heads} KV heads, so DCP shards "
                     "the tokens instead of replicating the heads (needs FlashAttention or FlashInfer)")
    return tp, dcp, notes


# -- the plan -------------------------------------------------------------------------------


CPU_DEVICE = GpuProfile("CPU", 0, 0.0, (0, 0), False, kind="cpu")


def _check_inputs(gpu: GpuProfile | None, targets: Targets, platform: Platform, kv_pool_bytes: int | None,
                  max_num_seqs: int | None) -> GpuProfile:
    """The device planned for (the CPU's stand-in on the CPU backend); PlanError for input that cannot be
    planned, before anything is computed."""
    if platform.kind == "cpu":
        gpu = CPU_DEVICE
        if kv_pool_bytes is None:
            raise PlanError("the CPU backend has no GPU memory to plan from: give the KV pool size")
        platform.isa  # noqa: B018  (refused here, before anything is planned, when the level is missing)
    if gpu is None:
        raise PlanError("no GPU given: name one (--gpu) or give its memory (--gpu-memory)")
    if kv_pool_bytes is not None and kv_pool_bytes <= 0:
        raise PlanError(f"the KV pool must be positive (got {kv_pool_bytes} bytes)")
    if kv_pool_bytes is None and gpu.memory_bytes <= 0:
        raise PlanError("GPU memory must be positive")
    if max_num_seqs is not None and max_num_seqs <= 0:
        raise PlanError(f"max_num_seqs must be positive (got {max_num_seqs})")
    if targets.sessions is not None and targets.sessions <= 0:
        raise PlanError(f"sessions must be positive (got {targets.sessions})")
    if targets.context is not None and targets.context < 16:
        raise PlanError(f"context must be at least 16 tokens (got {targets.context})")
    if not 0 < platform.gpu_memory_utilization <= 1:
        raise PlanError("gpu_memory_utilization must be in (0, 1]")
    return gpu


def _cpu_rules(model: ModelShape, targets: Targets, platform: Platform, notes: list[str]) -> Targets:
    """What vLLM's CPU backend refuses or changes at the host's level (kvbudget.cpu)."""
    if platform.kind != "cpu":
        return targets
    refusal = cpu.weight_kernel_refusal(model.weight_format, platform.isa)
    if refusal:
        raise PlanError(f"{model.name} cannot run on this CPU: {refusal}")
    slow = cpu.weight_kernel_note(model.weight_format)
    if slow:
        notes.append(slow)
    if model.mla_latent_dim and targets.prefix_caching and not cpu.mla_keeps_prefix_caching(platform.isa):
        # vLLM's CPU platform forces both off for MLA models without AMX (CpuPlatform.check_and_update_config).
        notes.append(f"vLLM's CPU backend turns prefix caching (and chunked prefill) off for MLA models "
                     f"on a {platform.isa} host (AMX_MLA keeps them)")
        return replace(targets, prefix_caching=False)
    return targets


def _context_findings(model: ModelShape, context: int) -> list[Finding]:
    if not model.max_position_embeddings or context <= model.max_position_embeddings:
        return []
    return [Finding(
        "context", f"{context:,} tokens", f"{model.max_position_embeddings:,} (max_position_embeddings)",
        100 * (context - model.max_position_embeddings) / context,
        ("a context beyond max_position_embeddings needs RoPE scaling (YaRN) configured in the model",
         f"or target {model.max_position_embeddings:,} tokens"),
    )]


def _engine_shape(model: ModelShape, targets: Targets, platform: Platform, kv_dtype: KvDtype, block: int, tp: int,
                  dcp: int, spec: Speculative, ctx: int) -> EngineShape:
    return EngineShape(
        max_model_len=ctx, kv_dtype=kv_dtype, block_size=block,
        kernel_block=block if platform.kind == "cpu" else 16,
        tp=tp, dcp=dcp, spec_method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
        draft_layers=draft_layers(spec, model, targets), max_num_batched_tokens=platform.batched_tokens(targets),
        max_concurrent_batches=1 if platform.kind == "cpu" else 2,
        # with AVX512-BF16 vLLM's CPU backend stores the recurrent state in float32 (platforms/cpu.py)
        ssm_dtype_bytes=cpu.state_dtype_bytes(platform.isa) if platform.kind == "cpu" else None,
        mamba_cache_mode="align" if targets.prefix_caching else "none",
    )


@dataclass(frozen=True)
class _Budget:
    """The device's memory split before the KV pool is laid out."""

    total: int
    budget: int  # what vLLM may use: the card times gpu_memory_utilization, or the given pool plus the rest
    weights: int
    draft_weights: int
    reserve: int

    @property
    def headroom(self) -> int:
        return max(0, self.total - self.budget)

    @property
    def need(self) -> int:
        return self.weights + self.draft_weights + self.reserve


def _budget(model: ModelShape, gpu: GpuProfile, targets: Targets, platform: Platform, spec: Speculative, tp: int,
            kv_pool_bytes: int | None, weight_bytes: int) -> _Budget:
    weights = cdiv(weight_bytes, tp)
    reserve = reserve_bytes(model, targets, platform, tp)
    draft_w = cdiv(targets.draft_model_bytes, tp) if spec.method == "eagle3" and targets.draft_model_bytes else 0
    if kv_pool_bytes is None:
        budget = int(gpu.memory_bytes * platform.gpu_memory_utilization)
    else:  # the pool is given; the rest of the card is whatever it is
        budget = kv_pool_bytes + weights + reserve
    return _Budget(gpu.memory_bytes, budget, weights, draft_w, reserve)


def _does_not_fit(b: _Budget, gpu: GpuProfile, platform: Platform) -> Finding:
    bigger = _bigger_cards(lambda g: int(g.memory_bytes * platform.gpu_memory_utilization) > b.need + GiB, gpu)
    return Finding(
        "fit", "the model on this GPU", f"short by {(b.need - b.budget) / 1e9:.1f} GB",
        100 * (b.need - b.budget) / b.need,
        (f"weights alone are {b.weights / 1e9:.1f} GB per GPU against a usable {b.budget / 1e9:.1f} GB",
         "a quantized checkpoint (FP8 halves bf16 weights, FP4 quarters them)",
         *(f"a bigger card: {name}" for name in bigger[:2]),
         "or more GPUs with tensor parallel (pipeline/expert sharding across boxes)"),
    )


def make_plan(model: ModelShape, gpu: GpuProfile | None, targets: Targets = Targets(), platform: Platform = Platform(),
              *, kv_pool_bytes: int | None = None, max_num_seqs: int | None = None) -> Plan:
    """kv_pool_bytes fixes the pool (the CPU backend, or an operator's explicit size) instead of
    deriving it from the GPU's memory; max_num_seqs fixes that setting instead of choosing it."""
    device = _check_inputs(gpu, targets, platform, kv_pool_bytes, max_num_seqs)
    plan = partial(_plan_with, model, device, targets, platform, kv_pool_bytes, max_num_seqs)
    refusal = weights.fp8_refusal(model, device, platform.kind == "cpu")
    if targets.weights == "fp8":
        if refusal:
            raise PlanError(f"targets.weights = \"fp8\": {refusal}")
        return _explained(plan(weights.fp8(model, device, "")), "asked for (targets.weights = \"fp8\")",
                          _offer(plan(weights.as_stored(model, "")), "16-bit weights", "model"))
    if targets.weights == "model":
        asked = "as stored, as asked (targets.weights = \"model\")"
        other = None if refusal else _offer(plan(weights.fp8(model, device, "")), "FP8 at load", "fp8")
        return _explained(plan(weights.as_stored(model, "")), asked, other)
    if refusal:
        kept = platform.kind == "cpu" or not weights.stored_16bit(model)
        return plan(weights.as_stored(model, "the checkpoint's own weights" if kept else f"as stored: {refusal}"))
    if not device.fp8:
        return plan(weights.as_stored(model, f"as stored: {device.name} has no FP8 tensor cores, so FP8 at load "
                                             "is not chosen by itself (targets.weights = \"fp8\" would run it "
                                             "weight-only)"))
    if kv_pool_bytes is not None:
        return plan(weights.as_stored(model, "as stored: the KV pool is fixed, so smaller weights would add no "
                                             "sessions (FP8 at load: targets.weights = \"fp8\")"))
    return _auto_weights(plan(weights.as_stored(model, "")), plan(weights.fp8(model, device, "")), targets)


def _auto_weights(as_is: Plan, small: Plan, targets: Targets) -> Plan:
    """`auto` on an FP8 card with a 16-bit checkpoint: FP8 at load where the 16-bit weights do not fit and
    FP8 does, or where it buys at least targets.fp8_weights_gain more sessions at the target context."""
    if not small.fits:
        return _explained(as_is, "as stored: the model does not fit even with FP8 weights", None)
    ctx = small.engine.max_model_len
    if not as_is.fits:
        return _explained(small, f"FP8 at load: the 16-bit weights do not fit this card, FP8's {_weights_gb(small)} do",
                          _offer(as_is, "16-bit weights", "model"))
    n16, n8 = _sessions(as_is), _sessions(small)
    gain = n8 / n16 - 1 if n16 else float("inf")
    figures = f"{n8:.1f} sessions at {ctx:,} tokens with FP8 weights against {n16:.1f} with 16-bit ones (+{gain:.0%})"
    if gain >= targets.fp8_weights_gain:
        return _explained(small, f"FP8 at load: {figures}, at least the {targets.fp8_weights_gain:.0%} asked "
                                 "(targets.fp8_weights_gain)", _offer(as_is, "16-bit weights", "model"))
    return _explained(as_is, f"as stored: FP8 at load would give {figures}, less than the "
                             f"{targets.fp8_weights_gain:.0%} that pays for its rounding (targets.fp8_weights_gain)",
                      _offer(small, "FP8 at load", "fp8"))


def _offer(plan: Plan, what: str, setting: str) -> str:
    """The other weight choice, in its own plan's figures."""
    got = (f"{_sessions(plan):.1f} sessions at {plan.engine.max_model_len:,} tokens, {_weights_gb(plan)}"
           if plan.fits else "does not fit")
    return f"{what} (targets.weights = \"{setting}\"): {got}"


def _weights_gb(plan: Plan) -> str:
    return f"{plan.memory.weights / 1e9:.1f} GB of weights per GPU"


def _sessions(plan: Plan) -> float:
    return plan.capacity.max_concurrency if plan.capacity else 0.0


def _explained(plan: Plan, reason: str, alternative: str | None) -> Plan:
    assert plan.weights is not None
    return replace(plan, weights=replace(plan.weights, reason=reason, alternative=alternative))


def _plan_with(model: ModelShape, device: GpuProfile, targets: Targets, platform: Platform, kv_pool_bytes: int | None,
               max_num_seqs: int | None, held: WeightChoice) -> Plan:
    """The plan with the weights held one way (kvbudget.weights)."""
    notes: list[str] = []
    tp, dcp, par_notes = parallelism(model, platform)
    notes += par_notes
    targets = _cpu_rules(model, targets, platform, notes)
    kv_dtype, dtype_note = choose_kv_dtype(targets, device, platform, model)
    if dtype_note:
        notes.append(dtype_note)
    context = targets.context or min(DEFAULT_CONTEXT[targets.workload], model.max_position_embeddings or 10**9)
    findings = _context_findings(model, context)
    spec = choose_speculative(model, targets, platform, memory_tight=False)
    b = _budget(model, device, targets, platform, spec, tp, kv_pool_bytes, held.bytes)
    block = attention_block_size(model, device, platform, kv_dtype)
    shape = partial(_engine_shape, model, targets, platform, kv_dtype, block, tp, dcp)
    pool = kv_pool_bytes if kv_pool_bytes is not None else b.budget - b.need
    if pool <= 0:
        findings.append(_does_not_fit(b, device, platform))
        mem = Memory(b.total, b.headroom, b.weights, b.draft_weights, b.reserve, 0, 0)
        return Plan(device, model, targets, platform, False, mem, shape(spec, context), None, None, {}, 0, spec,
                    None, tuple(findings), tuple(notes), (), weights=held, kv_dtype_why=dtype_note)
    eng = shape(spec, context)
    lay = layout(model, eng)
    cap = capacity(lay, eng, pool)
    if targets.sessions and cap.max_concurrency < targets.sessions and spec.method == "none" \
            and targets.workload != "tool-calling":
        tighter = choose_speculative(model, targets, platform, memory_tight=True)
        if tighter.method != spec.method:
            spec, eng = tighter, shape(tighter, context)
            lay = layout(model, eng)
            cap = capacity(lay, eng, pool)
    kv_pool = cap.num_blocks * lay.bytes_per_block
    mem = Memory(b.total, b.headroom, b.weights, b.draft_weights, b.reserve, kv_pool, pool - kv_pool)
    notes += list(lay.notes)
    notes += _prefix_caching_cost(model, targets, eng, cap, pool)
    findings += _capacity_findings(model, device, targets, platform, eng, lay, cap, pool)
    tpot, tpot_findings = _tpot_floor(device, targets, b)
    findings += tpot_findings
    if targets.ttft_p50_ms:
        notes.append(f"p50 TTFT target {targets.ttft_p50_ms:g} ms: prefill speed is measured, not planned; "
                     "admission control enforces it on live traffic")
    max_num_seqs = max_num_seqs or targets.sessions or _seqs_for(cap.max_concurrency)
    tools = plan_tools(model, model.chat_template, targets.tool_call_parser, targets.reasoning_parser)
    notes.append(tools.summary())
    args = [*_vllm_args(lay, eng, kv_pool, max_num_seqs, spec, kv_dtype, targets.prefix_caching), *held.args,
            *tools.args]
    return Plan(device, model, targets, platform, True, mem, eng, lay, cap, _sessions_at(model, eng, pool),
                max_num_seqs, spec, tpot, tuple(findings), tuple(notes), tuple(args), tools=tools, weights=held,
                kv_dtype_why=dtype_note)


def _prefix_caching_cost(model: ModelShape, targets: Targets, eng: EngineShape, cap: KvCapacity, pool: int) -> list[str]:
    """Without prefix caching vLLM keeps one state block per sequence instead of the align mode's two
    (three for Mamba2); the operator should know what the cache costs in sessions."""
    if not (model.state_layers and targets.prefix_caching):
        return []
    off = replace(eng, mamba_cache_mode="none")
    n_off = capacity(layout(model, off), off, pool).max_concurrency
    return [f"prefix caching costs sessions on this hybrid model: {cap.max_concurrency:.2f} at "
            f"{eng.max_model_len:,} tokens with it, {n_off:.2f} with --prefix-caching off (no reuse of shared prompt "
            "prefixes)"]


def _sessions_at(model: ModelShape, eng: EngineShape, pool: int) -> dict[int, float]:
    out = {}
    for ctx in sorted({*SESSION_CONTEXTS, eng.max_model_len}):
        if model.max_position_embeddings and ctx > model.max_position_embeddings:
            continue
        e = replace(eng, max_model_len=ctx)
        out[ctx] = capacity(layout(model, e), e, pool).max_concurrency
    return out


def _capacity_findings(model: ModelShape, gpu: GpuProfile, targets: Targets, platform: Platform, eng: EngineShape,
                       lay: KvLayout, cap: KvCapacity, pool: int) -> list[Finding]:
    out = []
    context = eng.max_model_len
    if cap.num_blocks < lay.blocks_per_request(eng):
        out.append(Finding("context", f"one request of {context:,} tokens",
                           f"{cap.max_concurrency:.2f} requests", 100 * (1 - cap.max_concurrency),
                           _remedies(model, gpu, targets, platform, eng, pool, eng.kv_dtype, 1, context)))
    if targets.sessions and cap.max_concurrency < targets.sessions:
        out.append(Finding(
            "sessions", f"{targets.sessions} sessions at {context:,} tokens", f"{cap.max_concurrency:.1f}",
            100 * (targets.sessions - cap.max_concurrency) / targets.sessions,
            _remedies(model, gpu, targets, platform, eng, pool, eng.kv_dtype, targets.sessions, context),
        ))
    return out


def _tpot_floor(gpu: GpuProfile, targets: Targets, b: _Budget) -> tuple[float | None, list[Finding]]:
    """Decode reads every weight (and the KV of the batch) once per step: a floor on TPOT."""
    if not gpu.bandwidth_bytes_s:
        return None, []
    tpot = 1000 * (b.weights + b.draft_weights) / gpu.bandwidth_bytes_s
    if not (targets.tpot_ms and tpot > targets.tpot_ms):
        return tpot, []
    return tpot, [Finding("tpot", f"{targets.tpot_ms:g} ms", f"at least {tpot:.1f} ms (memory bandwidth)",
                          100 * (tpot - targets.tpot_ms) / tpot,
                          ("a card with more memory bandwidth", "a quantized checkpoint (fewer bytes read per token)",
                           "speculative decoding (several tokens per weight read)"))]


def _vllm_args(lay: KvLayout, eng: EngineShape, kv_pool: int, max_num_seqs: int, spec: Speculative,
               kv_dtype: KvDtype, prefix_caching: bool) -> list[str]:
    # Every figure the KV arithmetic used is passed explicitly, so no engine default can differ from the plan.
    args = ["--kv-cache-memory-bytes", str(kv_pool), "--max-model-len", str(eng.max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(eng.max_num_batched_tokens),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if any(g.kind in STATE_KINDS for g in lay.groups):
        if eng.mamba_cache_mode == "all":
            raise PlanError("mamba cache mode 'all' exists only in older vLLM releases; plan with 'align' or 'none'")
        args += ["--mamba-cache-mode", eng.mamba_cache_mode]
    if kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    elif kv_dtype == "fp4":
        args += ["--kv-cache-dtype", "nvfp4"]
    if eng.tp > 1:
        args += ["--tensor-parallel-size", str(eng.tp)]
    if eng.dcp > 1:
        args += ["--decode-context-parallel-size", str(eng.dcp)]
    if (spec_json := spec.config_json()) is not None:
        args += ["--speculative-config", spec_json]
    return args


def _bigger_cards(ok, current: GpuProfile) -> list[str]:
    return [p.name for p in sorted(PROFILES, key=lambda p: p.memory_bytes)
            if p.memory_bytes > current.memory_bytes and ok(p)]


def _remedies(model: ModelShape, gpu: GpuProfile, targets: Targets, platform: Platform, eng: EngineShape,
              pool: int, kv_dtype: KvDtype, sessions: int, context: int) -> tuple[str, ...]:
    out = []
    if kv_dtype not in ("fp8", "fp4") and gpu.fp8 and platform.kind == "gpu":
        e8 = replace(eng, kv_dtype="fp8")
        c8 = capacity(layout(model, e8), e8, pool).max_concurrency
        out.append(f"FP8 KV cache: {c8:.1f} sessions at {context:,} tokens")
    lay = layout(model, eng)
    fit_sessions = capacity(lay, eng, pool).max_concurrency
    if fit_sessions >= 1:
        out.append(f"fewer sessions: {int(fit_sessions)} fit at {context:,} tokens")
    ctx = _longest_context_for(model, eng, pool, sessions)
    if ctx:
        out.append(f"shorter context: {sessions} sessions fit at {ctx:,} tokens")
    extra = pool_for_sessions(lay, eng, sessions) - pool  # > 0: only called for a shortfall
    bigger = _bigger_cards(lambda p: p.memory_bytes - gpu.memory_bytes > extra / platform.gpu_memory_utilization, gpu)
    if bigger:
        out.append(f"a bigger card: {bigger[0]} (needs {extra / 1e9:.1f} GB more KV pool)")
    return tuple(out)


def _longest_context_for(model: ModelShape, eng: EngineShape, pool: int, sessions: int) -> int | None:
    lo, hi = 0, eng.max_model_len
    step = max(eng.block_size, 256)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step or step
        e = replace(eng, max_model_len=mid)
        if capacity(layout(model, e), e, pool).max_concurrency >= sessions:
            lo = mid
        else:
            hi = mid
    return lo or None


# -- vLLM's own figures ----------------------------------------------------------------------


def require_modelled(plan: Plan) -> Plan:
    """A plan whose figures come from the kvbudget model alone, refused when its model has cache-holding
    layers the kvbudget model does not read: planned as attention they would be confidently wrong (for
    hybrids, several times fewer sessions than vLLM allocates)."""
    missing = plan.model.unmodelled
    if missing:
        raise PlanError(
            f"the kvbudget model does not understand {plan.model.name}'s {', '.join(missing)} (state-space, "
            "convolution or shared-block layers, or layer kinds it does not read), so a plan from it alone "
            "would be wrong; plan with vLLM's probe instead (without --model-only, with the engine environment: "
            "engine.python, or vLLM installed beside the appliance)")
    return plan



def follow_vllm(plan: Plan, vllm: VllmFigures) -> Plan:
    """The plan with vLLM's figures in place of the kvbudget model's, and every difference named.

    vLLM computed them for this plan's own command line, so they are what the engine will allocate; the
    model's figures stay on the plan (model_figures) when the two disagree.
    """
    if not plan.fits or plan.capacity is None or plan.layout is None:
        return replace(plan, source=vllm.source, vllm=vllm)
    ours, lay, e = plan.capacity, plan.layout, plan.engine
    model_groups = len(lay.groups)
    diffs = [f"{what}: kvbudget model {a}, vLLM {b}" for what, a, b in (
        ("block size", lay.block_size, vllm.block_size),
        ("KV cache groups", model_groups, vllm.group_count),
        ("page bytes", lay.page_bytes, vllm.page_bytes),
        ("blocks", ours.num_blocks, vllm.num_blocks),
        ("blocks per request", ours.blocks_per_request, vllm.blocks_per_request),
        ("max concurrency", f"{ours.max_concurrency:.4f}", f"{vllm.max_concurrency:.4f}"),
    ) if a != b]
    cap = replace(ours, num_blocks=vllm.num_blocks, blocks_per_request=vllm.blocks_per_request,
                  max_concurrency=vllm.max_concurrency, tokens_reported=vllm.kv_tokens)
    sessions_at = {ctx: vllm.sessions_at.get(ctx, n) for ctx, n in plan.sessions_at.items()}
    sessions_at[e.max_model_len] = vllm.max_concurrency
    findings = [f for f in plan.findings if f.target not in ("sessions", "context")]  # both recomputed below
    context = e.max_model_len
    if vllm.max_concurrency < 1:
        findings.append(Finding("context", f"one request of {context:,} tokens", f"{vllm.max_concurrency:.2f} requests",
                                100 * (1 - vllm.max_concurrency), ("a shorter context", "a bigger KV pool")))
    t = plan.targets
    if t.sessions and vllm.max_concurrency < t.sessions:
        findings.append(Finding("sessions", f"{t.sessions} sessions at {context:,} tokens",
                                f"{vllm.max_concurrency:.1f}", 100 * (t.sessions - vllm.max_concurrency) / t.sessions,
                                tuple(r for f in plan.findings if f.target == "sessions" for r in f.remedies)))
    seqs, args = plan.max_num_seqs, list(plan.vllm_args)
    if not t.sessions and seqs == _seqs_for(ours.max_concurrency):  # chosen from capacity, not fixed
        seqs = _seqs_for(vllm.max_concurrency)
        args[args.index("--max-num-seqs") + 1] = str(seqs)
    if plan.model.unmodelled:
        diffs.insert(0, f"the kvbudget model does not read {', '.join(plan.model.unmodelled)}: vLLM's figures "
                        "are the plan's")
    return replace(plan, capacity=cap, sessions_at=sessions_at, findings=tuple(findings), source=vllm.source,
                   vllm=vllm, model_figures=ours if diffs else None, disagreements=tuple(diffs),
                   max_num_seqs=seqs, vllm_args=tuple(args))


def _seqs_for(concurrency: float) -> int:
    return max(1, min(256, int(concurrency)))
