"""A Plan as a human table or as JSON. GB (10^9) and GiB (2^30) are always shown side by side."""

from __future__ import annotations

import shlex
from typing import Any

from kvbudget.accounting import kv_bytes_per_element
from kvbudget.model import STATE_KINDS
from kvbudget.plan_types import Plan


def gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB / {n / (1 << 30):,.2f} GiB"


def plan_dict(p: Plan) -> dict[str, Any]:
    m = p.memory
    d: dict[str, Any] = {
        "source": p.source,
        "fits": p.fits,
        "targets_met": p.targets_met,
        "gpu": {"name": p.gpu.name, "memory_bytes": p.gpu.memory_bytes, "count": p.platform.gpu_count,
                "compute_capability": "%d.%d" % p.gpu.compute_capability, "fp8": p.gpu.fp8, "fp4": p.gpu.fp4,
                "bandwidth_bytes_s": p.gpu.bandwidth_bytes_s, "memory_is_nvml_total": p.gpu.memory_is_nvml_total},
        "platform": p.platform.kind,
        "cpu_isa": p.platform.cpu_isa if p.platform.kind == "cpu" else None,
        "model": {"name": p.model.name, "architecture": p.model.architecture, "layers": p.model.num_layers,
                  "kv_layers": p.model.kv_layers, "linear_layers": p.model.count("linear"), "mamba_layers": p.model.count("mamba"),
                  "sliding_layers": p.model.count("sliding"), "weight_bytes": p.model.weight_bytes,
                  "weight_bytes_exact": p.model.weight_bytes_exact, "weight_format": p.model.weight_format or None},
        "targets": {"sessions": p.targets.sessions, "context": p.engine.max_model_len, "workload": p.targets.workload,
                    "kv_dtype": p.targets.kv_dtype},
        "memory_bytes": {"total": m.total, "headroom": m.headroom, "weights": m.weights, "draft_weights": m.draft_weights,
                         "activation_and_graph_reserve": m.reserve, "kv_pool": m.kv_pool, "unused": m.unused},
        "speculative": {"method": p.speculative.method, "num_speculative_tokens": p.speculative.num_speculative_tokens,
                        "reason": p.speculative.reason},
        "findings": [f.__dict__ | {"remedies": list(f.remedies)} for f in p.findings],
        "notes": list(p.notes),
        "vllm_args": list(p.vllm_args), "weights": _weights_dict(p),
        "tools": None if p.tools is None else {
            "tool_call_parser": p.tools.tool_call_parser, "reasoning_parser": p.tools.reasoning_parser,
            "auto_tool_choice": p.tools.auto, "template_renders_tools": p.tools.renders_tools, "why": p.tools.why},
    }
    if p.layout and p.capacity:
        d["kv"] = _kv_dict(p)
        d["sessions_at_context"] = {str(k): v for k, v in p.sessions_at.items()}
        d["tpot_floor_ms"] = p.tpot_floor_ms
    if p.vllm:
        v = p.vllm
        d["kv"].update({"block_size": v.block_size, "groups": v.group_count, "page_bytes": v.page_bytes})
        d["vllm"] = {"version": v.vllm_version, "platform": v.platform, "attention_backends": list(v.attention_backends),
                     "block_size": v.block_size, "kv_cache_dtype": v.kv_cache_dtype,
                     "mamba_cache_mode": v.mamba_cache_mode, "enable_prefix_caching": v.enable_prefix_caching,
                     "groups": [g.__dict__ for g in v.groups], "num_blocks": v.num_blocks,
                     "blocks_per_request": v.blocks_per_request, "max_concurrency": v.max_concurrency,
                     "kv_tokens": v.kv_tokens, "probe_seconds": v.seconds, "notes": list(v.notes),
                     "cpu_isa": v.cpu_isa}
    if p.disagreements and p.model_figures is not None and p.layout is not None:
        d["disagreements"] = list(p.disagreements)
        ours = p.model_figures
        d["kvbudget_model"] = {"block_size": p.layout.block_size, "groups": len(p.layout.groups),
                               "page_bytes": p.layout.page_bytes, "num_blocks": ours.num_blocks,
                               "blocks_per_request": ours.blocks_per_request, "max_concurrency": ours.max_concurrency,
                               "kv_tokens_reported": ours.tokens_reported}
    return d


def _kv_dict(p: Plan) -> dict[str, Any]:
    lay, cap = p.layout, p.capacity
    assert lay is not None and cap is not None
    return {
        "kv_dtype": p.engine.kv_dtype, "kv_dtype_why": p.kv_dtype_why, "block_size": lay.block_size,
        "page_bytes": lay.page_bytes,
        "per_token_kv_bytes": lay.per_token_kv_bytes,
        "per_sequence_state_bytes": lay.per_sequence_state_bytes(p.engine),
        "linear_state_real_bytes": lay.mamba_page_real, "linear_state_padding_pct": lay.mamba_padding_pct,
        "groups": len(lay.groups), "group_size": lay.group_size, "bytes_per_block": lay.bytes_per_block,
        "num_blocks": cap.num_blocks, "blocks_per_request": cap.blocks_per_request,
        "max_concurrency": cap.max_concurrency, "kv_tokens_reported": cap.tokens_reported,
        "kv_tokens_reported_legacy": cap.tokens_reported_legacy,
    }


def _weights_dict(p: Plan) -> dict[str, Any] | None:
    w = p.weights
    return None if w is None else {"scheme": w.scheme, "bytes": w.bytes, "vllm_args": list(w.args),
                                   "reason": w.reason, "quality": w.quality, "alternative": w.alternative}


def plan_text(p: Plan) -> str:
    lines = [
        f"Plan for {p.model.name} ({p.model.architecture}) on "
        + (f"the CPU backend ({p.platform.cpu_isa} host, fixed KV pool)" if p.platform.kind == "cpu" else
           f"{p.platform.gpu_count} x {p.gpu.name}" + ("" if p.gpu.memory_is_nvml_total else " (nominal memory)")),
        "",
        *_memory_lines(p),
    ]
    lines += _weight_lines(p)
    if p.layout and p.capacity:
        lines += _kv_lines(p)
    lines += ["", f"Speculative decoding: {p.speculative.method} ({p.speculative.reason})"]
    if p.findings:
        lines += ["", "TARGETS NOT MET" if p.fits else "DOES NOT FIT"]
        for f in p.findings:
            lines.append(f"  {f.target}: wanted {f.wanted}, got {f.achieved} (short by {f.shortfall_pct:.0f}%)")
            for r in f.remedies:
                lines.append(f"    - {r}")
    lines += ["", f"Figures from: {p.source}" + (f" ({p.vllm.platform}, attention backend "
                                                    f"{'/'.join(p.vllm.attention_backends)}, asked in {p.vllm.seconds:.1f} s)"
                                                    if p.vllm else "")]
    if p.disagreements:
        lines += ["  the kvbudget model disagrees; the plan follows vLLM:"] + [f"    - {d}" for d in p.disagreements]
    if p.notes:
        lines += ["", "Notes"] + [f"  - {n}" for n in p.notes]
    if p.vllm_args:
        lines += ["", "vLLM arguments", "  " + shlex.join(p.vllm_args)]
    return "\n".join(lines)


def _memory_lines(p: Plan) -> list[str]:
    m = p.memory
    lines = ["Memory per GPU" if m.total else "Memory"]
    if m.total:
        lines += [
            f"  total                         {gb(m.total)}",
            f"  headroom (held back)          {gb(m.headroom)}  ({(1 - p.platform.gpu_memory_utilization) * 100:.0f}%)",
        ]
    held = "  (FP8 at load)" if p.weights and p.weights.scheme == "fp8" else ""
    lines.append(f"  weights                       {gb(m.weights)}" + ("" if p.model.weight_bytes_exact else "  (estimated)")
                 + held)
    if m.draft_weights:
        lines.append(f"  draft weights                 {gb(m.draft_weights)}")
    if m.reserve:
        lines.append(f"  activation + graph reserve    {gb(m.reserve)}  (estimated)")
    lines.append(f"  KV pool                       {gb(m.kv_pool)}")
    return lines


def _weight_lines(p: Plan) -> list[str]:
    w = p.weights
    if w is None:
        return []
    name = "FP8, quantized by vLLM at load (--quantization fp8)" if w.scheme == "fp8" else (
        f"as stored ({p.model.weight_format or p.model.quantization or f'{8 * p.model.dtype_bytes}-bit'})")
    lines = ["", f"Weights: {name}", f"  why                           {w.reason}"]
    if w.quality:
        lines.append(f"  gives up                      {w.quality}")
    if w.alternative:
        lines.append(f"  instead                       {w.alternative}")
    return lines


def _kv_lines(p: Plan) -> list[str]:
    lay, cap, e = p.layout, p.capacity, p.engine
    assert lay is not None and cap is not None
    lines = [
        "",
        f"KV cache ({'model dtype' if e.kv_dtype == 'auto' else e.kv_dtype}, block {lay.block_size} tokens)",
        f"  per-token KV                  {lay.per_token_kv_bytes:,.0f} B over {p.model.kv_layers} of "
        f"{p.model.num_layers} layers",
    ]
    if lay.mamba_page_real:
        lines.append(
            f"  per-sequence linear state     {lay.per_sequence_state_bytes(e):,} B as allocated "
            f"({p.model.state_layers} layers x {lay.mamba_page_real:,} B real, page padded "
            f"{lay.mamba_padding_pct:.2f}%, {e.mamba_cache_mode} mode)"
        )
    lines += [
        f"  groups x layers               {len(lay.groups)} x {lay.group_size}; one block id = {lay.bytes_per_block:,} B",
        f"  blocks                        {cap.num_blocks:,} ({cap.blocks_per_request} per request at {e.max_model_len:,} tokens)",
        f"  KV tokens (vLLM log)          {cap.tokens_reported:,}   [vLLM <= 0.19 logged {cap.tokens_reported_legacy:,}]",
        f"  max concurrency               {cap.max_concurrency:.2f} requests at {e.max_model_len:,} tokens",
        "",
        "Sessions that fit, by context length",
    ]
    for ctx, n in p.sessions_at.items():
        lines.append(f"  {ctx:>9,} tokens             {n:,.1f}")
    if p.tpot_floor_ms:
        lines.append(f"\nDecode floor (weights / bandwidth): {p.tpot_floor_ms:.1f} ms per token")
    return [*lines, "", "Reality check against a per-token estimate", *(f"  - {r}" for r in reality_check(p))]


def reality_check(p: Plan) -> list[str]:
    """Why the sessions that fit are fewer than `pool / per-token KV / context` suggests."""
    assert p.layout and p.capacity
    lay, cap, e, m = p.layout, p.capacity, p.engine, p.memory
    # bytes per element -> per-token figures for both the model dtype and FP8
    per_elem_token = lay.attn_page_per_token / kv_bytes_per_element(p.model, e)
    kv_layers = sum(g.layers for g in lay.groups if g.kind not in STATE_KINDS)
    out = [
        f"per-token KV: {int(per_elem_token * p.model.dtype_bytes * kv_layers):,} B in the model dtype, "
        f"{int(per_elem_token * kv_layers):,} B in FP8 ({kv_layers} of {p.model.num_layers + e.draft_layers} layers keep KV)",
    ]
    if m.total:
        out.append(
            f"units: the card's {m.total / (1 << 20):,.0f} MiB are {m.total / 1e9:.2f} GB but {m.total / (1 << 30):.2f} GiB; "
            f"vLLM also holds back {(1 - p.platform.gpu_memory_utilization) * 100:.0f}% ({m.headroom / 1e9:.2f} GB) and "
            f"{m.reserve / 1e9:.2f} GB for activations and CUDA graphs")
    naive_tokens = m.kv_pool / lay.per_token_kv_bytes
    naive_sessions = naive_tokens / e.max_model_len
    out.append(
        f"per-token estimate: {m.kv_pool / 1e9:.2f} GB pool / {lay.per_token_kv_bytes:,.0f} B = {naive_tokens:,.0f} tokens "
        f"= {naive_sessions:.1f} sessions at {e.max_model_len:,}; vLLM will admit {cap.max_concurrency:.1f}"
    )
    if lay.mamba_page_real:
        state = lay.per_sequence_state_bytes(e)
        kept = 3 if p.model.mamba else 2  # Mamba2 mixers add a prefill checkpoint block
        mode = f"align mode keeps {kept} states per layer" if e.mamba_cache_mode == "align" else e.mamba_cache_mode
        out.append(
            f"linear-attention state: every sequence also holds {state / (1 << 20):,.0f} MiB "
            f"({p.model.state_layers} layers x {lay.mamba_page_real:,} B, {mode}), whatever its length; "
            f"at {cap.max_concurrency:.0f} sessions that is {cap.max_concurrency * state / 1e9:.1f} GB of the pool"
        )
    full_blocks = -(-e.max_model_len // lay.block_size)
    out.append(
        f"block granularity: {lay.block_size}-token blocks, so a {e.max_model_len:,}-token request takes "
        f"{full_blocks} blocks = {full_blocks * lay.block_size:,} token slots per group"
        + (f"; {len(lay.groups)} groups of {lay.group_size} layers share one block id" if len(lay.groups) > 1 else "")
    )
    if p.model.max_position_embeddings:
        out.append(f"contexts beyond {p.model.max_position_embeddings:,} tokens (max_position_embeddings) need RoPE "
                   f"scaling; FP4 KV needs Blackwell, which {p.gpu.name} {'is' if p.gpu.fp4 else 'is not'}")
    return out
