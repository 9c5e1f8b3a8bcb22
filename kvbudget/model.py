"""A model's shape from its config.json: pure data in, pure data out (kvbudget.model_files reads the files)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

# Cache-holding modules, in layer order: attention (full, sliding window, chunked local, MLA) keeps
# per-token KV; linear (Gated DeltaNet) and mamba (Mamba2) keep a fixed recurrent state per sequence.
LayerKind = Literal["full", "sliding", "chunked", "mla", "linear", "mamba"]
STATE_KINDS: tuple[LayerKind, ...] = ("linear", "mamba")

DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2,
    "float8_e4m3fn": 1, "float8": 1, "fp8": 1, "int8": 1, "uint8": 1,
}


class ModelError(ValueError):
    """The model cannot be read or is not something the appliance can serve."""


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5 / Qwen3.6) linear-attention layer shape."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    ssm_dtype_bytes: int

    @property
    def conv_dim(self) -> int:
        return self.key_head_dim * self.num_key_heads * 2 + self.value_head_dim * self.num_value_heads


@dataclass(frozen=True)
class Mamba2State:
    """A Mamba2 mixer's state shape (Granite-4.0-H, Nemotron-H, Falcon-H1), as vLLM's
    MambaStateShapeCalculator.mamba2_state_shape computes it."""

    intermediate_size: int
    n_groups: int
    num_heads: int
    head_dim: int
    state_size: int
    conv_kernel: int
    ssm_dtype_bytes: int | None = None  # None: the model dtype

    def conv_dim(self, tp: int) -> int:
        # vLLM replicates groups so that every head shard has its own: tp groups when they do not divide.
        groups = self.n_groups if self.n_groups % tp == 0 else tp
        return (self.intermediate_size + 2 * groups * self.state_size) // tp


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str
    layer_kinds: tuple[LayerKind, ...]
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype_bytes: int
    sliding_window: int | None = None
    mla_latent_dim: int | None = None  # kv_lora_rank + qk_rope_head_dim
    linear: LinearAttention | None = None
    mamba: Mamba2State | None = None
    attention_chunk_size: int | None = None
    model_type: str = ""
    layers: int = 0  # decoder layers (a layer can hold attention and a Mamba2 mixer side by side)
    intermediate_size: int | None = None
    num_experts: int = 0
    moe_intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    quantization: str | None = None
    weight_bits: float | None = None
    mtp_layers: int = 0
    weight_format: str = ""  # "method/algo/format[+block]" of the quantization config ("" when unquantized)
    weight_bytes: int = 0
    weight_bytes_exact: bool = False
    notes: tuple[str, ...] = field(default=())
    # Settings of config.json that describe cache-holding layers this model does not read (state-space,
    # convolution, shared blocks, layer kinds): planned alone, its figures would be wrong. vLLM's probe
    # plans such a model; the kvbudget model alone refuses it (kvbudget.planner.require_modelled).
    unmodelled: tuple[str, ...] = field(default=())
    # The chat template (tokenizer_config.json's or chat_template.jinja), for the tool-calling choice
    # (kvbudget.tools); None when the folder has none or only config.json was read.
    chat_template: str | None = field(default=None, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return self.layers or len(self.layer_kinds)

    def count(self, kind: LayerKind) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def is_hybrid_linear(self) -> bool:
        return self.count("linear") > 0

    @property
    def state_layers(self) -> int:
        return sum(self.count(k) for k in STATE_KINDS)

    @property
    def kv_layers(self) -> int:
        """Modules that keep a per-token KV cache."""
        return len(self.layer_kinds) - self.state_layers


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Multimodal checkpoints (Qwen3.5/3.6, Gemma 3, ...) nest the language model's fields.
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        merged = {k: v for k, v in cfg.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return cfg


def _req(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise ModelError(f"config.json lacks {' / '.join(keys)}; cannot size the KV cache without it")


def positive_int(cfg: dict[str, Any], *keys: str) -> int:
    v = _req(cfg, *keys)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelError(f"config.json {keys[0]} must be a positive integer (got {v!r})")
    return v


def _dtype_bytes(name: Any, default: int = 2) -> int:
    if name is None:
        return default
    key = str(name).replace("torch.", "").lower()
    if key not in DTYPE_BYTES:
        raise ModelError(f"unknown dtype {name!r} in config.json")
    return DTYPE_BYTES[key]


# Fields transformers fills in when a config.json leaves them out (the defaults of its config classes),
# which vLLM then reads: Gemma-3's published configs omit head_dim, whose default is not hidden / heads.
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 256},
    "gemma2": {"head_dim": 256},
    "gemma3_text": {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "max_position_embeddings": 131072, "vocab_size": 262208},
    "cohere2": {"sliding_window_pattern": 4},
    "llama4_text": {"no_rope_layer_interval": 4},
}
# ChatGLM (THUDM) names its fields its own way.
CHATGLM_FIELDS = {"num_layers": "num_hidden_layers", "kv_channels": "head_dim", "padded_vocab_size": "vocab_size",
                  "seq_length": "max_position_embeddings", "ffn_hidden_size": "intermediate_size"}
# Architectures vLLM serves as generative models although their names do not say so.
GENERATIVE_ARCHITECTURES = {"ChatGLMModel"}


def _with_defaults(t: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in CONFIG_DEFAULTS.get(str(t.get("model_type", "")), {}).items()}
    out.update({k: v for k, v in t.items() if v is not None})
    if out.get("model_type") == "chatglm":
        for theirs, ours in CHATGLM_FIELDS.items():
            if theirs in out and ours not in out:
                out[ours] = out[theirs]
        if out.get("multi_query_attention") and out.get("multi_query_group_num"):
            out["num_key_value_heads"] = out["multi_query_group_num"]
    return out


LAYER_TYPE_NAMES: dict[str, str] = {
    "full_attention": "attn", "attention": "attn", "sliding_attention": "sliding",
    "sliding_window_attention": "sliding", "chunked_attention": "chunked", "linear_attention": "linear",
    "mamba": "mamba", "mamba2": "mamba",
}


# Names of config.json settings that describe recurrent or convolutional state (Mamba, Gated DeltaNet,
# short convolutions, RG-LRU, RWKV, ...) and of settings that lay out which layer is which kind.
STATE_SETTING = re.compile(r"mamba|ssm|state_size|d_state|d_conv|conv|linear_attn|linear_attention|^linear_|"
                           r"recurrent|rwkv|xlstm|(^|_)lru|deltanet|delta_net|retention|time_step|dt_rank|^expand$",
                           re.IGNORECASE)
LAYER_PLAN_SETTING = re.compile(r"layer_types|layers_block_type|block_types?$|attn_layer_(period|offset|indices)|"
                                r"attn_type_list|hybrid|shared_(attention|transformer|block)|mem_blocks|"
                                r"mb_per_layer|layer_pattern|mixer_types?|swa_layers|global_attn_layers|"
                                r"full_attn_layers|full_attention_interval|attention_layer|attn_idxs|"
                                # layers that read another layer's KV cache (Gemma 3n, Gemma 4)
                                r"kv_shar", re.IGNORECASE)


def _unmodelled(cfg: dict[str, Any], kinds: tuple[str, ...], unknown_types: set[str]) -> tuple[str, ...]:
    """The settings describing cache-holding layers that the layer kinds were not derived from, after the
    layer kinds not understood (worded already)."""
    used = {"layer_types", "hybrid_override_pattern"}
    if "linear" in kinds:
        used.add("full_attention_interval")
    has_state = any(k in STATE_KINDS for k in kinds)
    out = sorted(unknown_types)
    for key, value in cfg.items():
        if value is None or value is False or key in used:
            continue
        if LAYER_PLAN_SETTING.search(key) or (STATE_SETTING.search(key) and not has_state):
            out.append(key)
    return tuple(out)


def _layer_kinds(cfg: dict[str, Any], n: int) -> tuple[tuple[str, ...], set[str]]:  # each a LayerKind
    """The cache-holding modules in layer order, the way the model's vLLM class builds them, and the
    layer_types entries not understood (planned as attention: only vLLM's probe can plan them)."""
    mla = cfg.get("kv_lora_rank") is not None
    attn: LayerKind = "mla" if mla else "full"
    model_type = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != n:
            raise ModelError(f"config.json layer_types has {len(types)} entries for {n} layers")
        out, unknown = [], set()
        for t in types:
            kind = LAYER_TYPE_NAMES.get(t, "attn")
            if t not in LAYER_TYPE_NAMES:
                unknown.add(f"layer_types entry {t!r}")
            out.append(attn if kind == "attn" else kind)
        if "linear" in out and cfg.get("linear_num_value_heads") is None:
            # linear_attention layers without Gated DeltaNet's settings (MiniMax's lightning attention, Kimi's
            # KDA): another recurrent state, which only vLLM's probe can size.
            out = [attn if k == "linear" else k for k in out]
            unknown.add("layer_types entry 'linear_attention' (not Gated DeltaNet: no linear_* settings)")
        return tuple(out), unknown
    return _layer_kinds_without_types(cfg, n, attn, mla, model_type), set()


def _layer_kinds_without_types(cfg: dict[str, Any], n: int, attn: LayerKind, mla: bool,
                               model_type: str) -> tuple[str, ...]:
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        # Nemotron-H: M is a Mamba2 mixer, * an attention layer, - and E are MLP / MoE layers (no cache).
        if len(pattern) != n:
            raise ModelError(f"config.json hybrid_override_pattern has {len(pattern)} entries for {n} layers")
        return tuple("mamba" if c == "M" else attn for c in pattern if c in "M*")
    if model_type == "falcon_h1":
        # Every Falcon-H1 layer runs attention and a Mamba2 mixer side by side: both keep a cache.
        return (attn,) * n + ("mamba",) * n
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0 and cfg.get("linear_num_value_heads"):
        # Qwen3-Next style: every interval-th layer is full attention, the rest linear.
        return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n))
    if mla:
        return ("mla",) * n
    chunk = cfg.get("attention_chunk_size")
    if chunk:
        # Llama-4: layers with RoPE attend within chunks; the NoPE layers (no_rope_layers[i] == 0) are global.
        no_rope = cfg.get("no_rope_layers")
        if not isinstance(no_rope, list) or len(no_rope) != n:
            every = int(cfg.get("no_rope_layer_interval") or 4)
            no_rope = [int((i + 1) % every != 0) for i in range(n)]
        return tuple("chunked" if no_rope[i] else "full" for i in range(n))
    window = cfg.get("sliding_window")
    if window:
        if model_type == "gemma2":  # alternating, starting with a sliding layer
            return tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
        period = cfg.get("sliding_window_pattern")
        if isinstance(period, int) and period > 0:  # Gemma-3, Cohere2: every `period`-th layer is global
            return tuple("full" if (i + 1) % period == 0 else "sliding" for i in range(n))
        if "use_sliding_window" not in cfg:  # Mistral style: a window means every layer uses it
            return ("sliding",) * n
        if cfg["use_sliding_window"]:  # Qwen2 style: layers from max_window_layers on
            start = int(cfg.get("max_window_layers") or 0)
            return tuple("sliding" if i >= start else "full" for i in range(n))
    return ("full",) * n


def _mamba2(t: dict[str, Any], hidden: int, dtype_bytes: int) -> Mamba2State:
    """Mamba2 state fields under the names each family uses (granitemoehybrid and falcon_h1: mamba_*;
    nemotron_h: mamba_num_heads / ssm_state_size / conv_kernel)."""
    heads = positive_int(t, "mamba_n_heads", "mamba_num_heads")
    head_dim = positive_int(t, "mamba_d_head", "mamba_head_dim")
    if t.get("model_type") == "nemotron_h":
        inter = heads * head_dim
    else:
        inter = t.get("mamba_d_ssm") or int(float(t.get("mamba_expand") or t.get("expand") or 2) * hidden)
    ssm = t.get("mamba_ssm_dtype") or t.get("mamba_ssm_cache_dtype")
    if ssm is None and t.get("model_type") == "nemotron_h":
        ssm = "float32"  # vLLM's NemotronHForCausalLMConfig: float32 unless the config names another
    return Mamba2State(
        intermediate_size=int(inter),
        n_groups=positive_int(t, "mamba_n_groups", "n_groups"),
        num_heads=heads,
        head_dim=head_dim,
        state_size=positive_int(t, "mamba_d_state", "ssm_state_size"),
        conv_kernel=positive_int(t, "mamba_d_conv", "conv_kernel"),
        ssm_dtype_bytes=_dtype_bytes(ssm) if ssm else None,
    )


def _weight_format(cfg: dict[str, Any]) -> str:
    """The checkpoint's quantization as "method/algo/format[+block]" in lower case ("" when unquantized):
    what chooses a weight kernel (kvbudget.cpu.weight_kernel_refusal)."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return ""
    parts = [str(q[k]).lower() for k in ("quant_method", "quant_algo", "format") if q.get(k)]
    return "/".join(parts) + ("+block" if q.get("weight_block_size") else "")


def _quantization(cfg: dict[str, Any]) -> tuple[str | None, float | None]:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None, None
    method = str(q.get("quant_method") or q.get("quant_algo") or "unknown").lower()
    bits = q.get("bits") or q.get("weight_bits")
    if bits is None:
        if "fp8" in method or q.get("fmt") in ("e4m3", "float8_e4m3fn"):
            bits = 8
        elif "fp4" in method or "nvfp4" in method or "mxfp4" in method:
            bits = 4
    return method, float(bits) if bits else None


def shape_from_config(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """The model's shape from a parsed config.json, with weights estimated (labelled as such)."""
    arch = _generative_architecture(cfg)
    t = _with_defaults(text_config(cfg))
    n_layers = positive_int(t, "num_hidden_layers", "n_layer", "num_layers")
    heads = positive_int(t, "num_attention_heads", "n_head")
    hidden = positive_int(t, "hidden_size", "n_embd", "d_model")
    kv_heads = t.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ModelError(f"config.json num_key_value_heads must be a positive integer (got {kv_heads!r})")
    head_dim = t.get("head_dim") or t.get("attention_head_dim") or hidden // heads
    derived, unknown_types = _layer_kinds(t, n_layers)
    kinds = cast(tuple[LayerKind, ...], derived)
    dtype_bytes = _dtype_bytes(t.get("torch_dtype") or t.get("dtype") or cfg.get("torch_dtype"))

    mla_dim = None
    if t.get("kv_lora_rank") is not None:
        mla_dim = int(t["kv_lora_rank"]) + int(t.get("qk_rope_head_dim") or 0)

    mamba = _mamba2(t, hidden, dtype_bytes) if "mamba" in kinds else None
    linear = _gated_deltanet(t, dtype_bytes) if "linear" in kinds else None
    window = t.get("sliding_window") if "sliding" in kinds else None
    quant, bits = _quantization(t)
    shape = ModelShape(
        name=name,
        architecture=arch,
        layer_kinds=kinds,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        hidden_size=hidden,
        vocab_size=int(t.get("vocab_size") or 0),
        max_position_embeddings=int(t.get("max_position_embeddings") or 0),
        dtype_bytes=dtype_bytes,
        sliding_window=int(window) if window else None,
        mla_latent_dim=mla_dim,
        linear=linear,
        mamba=mamba,
        attention_chunk_size=int(t["attention_chunk_size"]) if "chunked" in kinds else None,
        model_type=str(t.get("model_type", "")),
        layers=n_layers,
        intermediate_size=_widest(t.get("intermediate_size")),
        num_experts=int(t.get("num_experts") or t.get("n_routed_experts") or t.get("num_local_experts") or 0),
        moe_intermediate_size=_widest(t.get("moe_intermediate_size")),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        quantization=quant,
        weight_bits=bits,
        weight_format=_weight_format(t),
        unmodelled=_unmodelled(t, derived, unknown_types),
        mtp_layers=int(t.get("mtp_num_hidden_layers") or t.get("num_nextn_predict_layers") or 0),
    )
    return replace(shape, weight_bytes=estimate_weight_bytes(shape), weight_bytes_exact=False,
                   notes=("weight bytes estimated from the architecture (no safetensors read)",))


def _generative_architecture(cfg: Any) -> str:
    if not isinstance(cfg, dict):
        raise ModelError("config.json must hold a JSON object")
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else str(cfg.get("model_type", ""))
    if not arch:
        raise ModelError("config.json names no architecture (architectures / model_type)")
    if not (arch.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")) or arch in GENERATIVE_ARCHITECTURES):
        raise ModelError(
            f"{arch} is not a causal language model (expected an architecture ending in ForCausalLM); "
            "the appliance serves generative chat models"
        )
    return str(arch)


def _gated_deltanet(t: dict[str, Any], dtype_bytes: int) -> LinearAttention:
    return LinearAttention(
        num_key_heads=positive_int(t, "linear_num_key_heads"),
        num_value_heads=positive_int(t, "linear_num_value_heads"),
        key_head_dim=positive_int(t, "linear_key_head_dim"),
        value_head_dim=positive_int(t, "linear_value_head_dim"),
        conv_kernel=positive_int(t, "linear_conv_kernel_dim"),
        # Qwen3.5/3.6 set float32; Qwen3-Next leaves it to the model dtype (bf16).
        ssm_dtype_bytes=_dtype_bytes(t.get("mamba_ssm_dtype"), default=dtype_bytes),
    )


def _widest(size: Any) -> int | None:
    """An MLP width, or the widest of per-layer widths (Gemma 3n lists one per layer): the weight
    estimate's input only, never the KV cache's."""
    if isinstance(size, list):
        widths = [w for w in size if isinstance(w, int) and not isinstance(w, bool)]
        return max(widths) if widths else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def estimate_weight_bytes(s: ModelShape) -> int:
    """Parameter count from the architecture times the stored bytes per weight.

    An estimate: biases, norms and vision towers are ignored, and quantized checkpoints keep
    embeddings and norms in 16 bits.
    """
    h = s.hidden_size
    q_dim = s.num_attention_heads * s.head_dim
    kv_dim = s.num_kv_heads * s.head_dim
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if s.linear:
        la = s.linear
        lin = h * (la.conv_dim + la.num_value_heads * la.value_head_dim) + la.num_value_heads * la.value_head_dim * h
    else:
        lin = 0
    experts = 0
    if s.num_experts:
        per_expert = s.moe_intermediate_size or s.intermediate_size or 4 * h
        experts = s.num_experts * 3 * h * int(per_expert)
        dense_mlp = 3 * h * int(s.intermediate_size) if s.moe_intermediate_size and s.intermediate_size else 0
    else:
        dense_mlp = 3 * h * int(s.intermediate_size or 4 * h)
    mixers = sum(lin if k == "linear" else attn for k in s.layer_kinds)
    embed = s.vocab_size * h * (1 if s.tie_word_embeddings else 2)
    quant_bytes = (s.weight_bits / 8) if s.weight_bits else s.dtype_bytes
    # MXFP4 checkpoints (gpt-oss) quantize only the experts; other methods the whole body.
    body_bytes = s.dtype_bytes if s.quantization == "mxfp4" else quant_bytes
    return int(s.num_layers * experts * quant_bytes + (mixers + s.num_layers * dense_mlp) * body_bytes
               + embed * min(s.dtype_bytes, 2))
