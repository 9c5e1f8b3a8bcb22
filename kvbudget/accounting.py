"""vLLM's KV cache arithmetic (v1 engine, 0.3x), reproduced without importing vLLM.

Follows vllm/v1/kv_cache_interface.py, vllm/v1/core/kv_cache_utils.py and
Platform._align_hybrid_block_size for the layer-outer KV layouts vLLM picks by
default (LBHNC/LBNHC). Each step names the vLLM function it mirrors; the tests
compare these numbers with vLLM's own functions and with the engine's log.

All sizes are per GPU (per tensor-parallel rank), in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from kvbudget.model import STATE_KINDS, LayerKind, ModelShape

KvDtype = Literal["auto", "bf16", "fp16", "fp8", "fp4"]
KV_DTYPES: tuple[KvDtype, ...] = get_args(KvDtype)
MambaCacheMode = Literal["none", "align", "all"]
SpecMethod = Literal["none", "ngram", "eagle", "eagle3", "mtp"]

KV_DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5}
GPU_DEFAULT_BLOCK_SIZE = 16
CPU_DEFAULT_BLOCK_SIZE = 128
# Smallest kernel block of the default GPU attention backends (FlashAttention/FlashInfer).
GPU_KERNEL_BLOCK = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EngineShape:
    """The engine settings that change the KV arithmetic."""

    max_model_len: int
    kv_dtype: KvDtype = "auto"
    block_size: int = GPU_DEFAULT_BLOCK_SIZE
    kernel_block: int = GPU_KERNEL_BLOCK
    tp: int = 1
    dcp: int = 1
    spec_method: SpecMethod = "none"
    num_speculative_tokens: int = 0
    draft_layers: int = 0  # EAGLE/MTP attention layers that join the KV pool
    mamba_cache_mode: MambaCacheMode = "align"  # vLLM's default with prefix caching on
    max_num_batched_tokens: int = 8192
    max_concurrent_batches: int = 2  # 2 with async scheduling (the GPU default), else 1
    ssm_dtype_bytes: int | None = None  # overrides the model's recurrent-state dtype (the CPU backend uses 4)

    @property
    def in_flight_tokens(self) -> int:
        """VllmConfig.max_in_flight_tokens: every concurrent batch may hold a full max_num_batched_tokens."""
        return self.max_concurrent_batches * self.max_num_batched_tokens

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "kernel_block", "tp", "dcp", "max_num_batched_tokens",
                     "max_concurrent_batches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive (got {getattr(self, name)})")
        if self.num_speculative_tokens < 0 or self.draft_layers < 0:
            raise ValueError("speculative token and draft layer counts cannot be negative")


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache on one rank, like vLLM's FullAttentionSpec / SlidingWindowSpec / MambaSpec."""

    kind: LayerKind
    page_bytes: int  # after padding (a recurrent state is padded to the attention page)
    block_size: int
    sliding_window: int | None = None
    chunk_size: int | None = None

    def blocks_per_request(self, e: EngineShape) -> int:
        """vLLM: cdiv(spec.max_memory_usage_bytes(cfg), spec.page_size_bytes)."""
        if self.kind in ("full", "mla"):
            return cdiv(cdiv(e.max_model_len, e.dcp), self.block_size)
        if self.kind == "sliding":
            assert self.sliding_window is not None
            tokens = min(self.sliding_window - 1 + e.in_flight_tokens, e.max_model_len)
            return cdiv(tokens, self.block_size) + 1
        if self.kind == "chunked":  # ChunkedLocalAttentionSpec: one chunk plus the tokens in flight
            assert self.chunk_size is not None
            return cdiv(min(self.chunk_size + e.in_flight_tokens, e.max_model_len), self.block_size)
        spec_blocks = e.num_speculative_tokens
        if e.mamba_cache_mode == "align":
            # MambaSpec: the running state and the last block boundary's; Mamba2 mixers also keep a
            # prefill checkpoint block (MambaMixer2.get_kv_cache_spec).
            return 2 + spec_blocks + (1 if self.kind == "mamba" else 0)
        if e.mamba_cache_mode == "all":  # releases before 0.2x kept a state per block
            return cdiv(e.max_model_len, self.block_size)
        return 1 + spec_blocks


@dataclass(frozen=True)
class Group:
    kind: str
    layers: int  # real layers in this group (the rest of group_size is padding)
    spec: LayerSpec


@dataclass(frozen=True)
class KvLayout:
    """What vLLM will build for a given pool: groups, block size, blocks, capacity."""

    block_size: int
    attn_page_per_token: float
    page_bytes: int
    mamba_page_real: int | None
    mamba_padding_pct: float | None
    groups: tuple[Group, ...]
    group_size: int
    bytes_per_block: int
    kv_heads_per_rank: int
    kv_heads_replicated: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def per_token_kv_bytes(self) -> float:
        """Bytes of per-token KV across the layers that keep one (excludes recurrent state)."""
        return self.attn_page_per_token * sum(g.layers for g in self.groups if g.kind not in STATE_KINDS)

    def blocks_per_request(self, e: EngineShape) -> int:
        return sum(g.spec.blocks_per_request(e) for g in self.groups)

    def per_sequence_state_bytes(self, e: EngineShape) -> int:
        """Fixed bytes one request holds for linear-attention state, as allocated.

        Every group draws block ids from one pool, and one block id costs `bytes_per_block`
        (group_size pages), so the state costs its blocks times that, padding included.
        """
        return sum(g.spec.blocks_per_request(e) for g in self.groups if g.kind in STATE_KINDS) * self.bytes_per_block


@dataclass(frozen=True)
class KvCapacity:
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float
    tokens_reported: int  # current vLLM: int(max_concurrency * max_model_len)
    tokens_reported_legacy: int  # vLLM <= 0.19: num_blocks // groups * block_size * dcp
    pool_bytes: int
    used_bytes: int


def kv_bytes_per_element(shape: ModelShape, e: EngineShape) -> float:
    if e.kv_dtype == "auto":
        return float(shape.dtype_bytes)
    return KV_DTYPE_BYTES[e.kv_dtype]


def state_bytes(shape: ModelShape, e: EngineShape) -> int | None:
    """One sequence's recurrent state in one layer, unpadded (MambaSpec.real_page_size_bytes)."""
    if shape.linear:  # Gated DeltaNet: conv state + (value heads x value dim x key dim) recurrent state
        la = shape.linear
        conv = (la.conv_kernel - 1 + e.num_speculative_tokens) * (la.conv_dim // e.tp) * shape.dtype_bytes
        return conv + (la.num_value_heads // e.tp) * la.value_head_dim * la.key_head_dim * (
            e.ssm_dtype_bytes or la.ssm_dtype_bytes)
    if shape.mamba:  # Mamba2: conv state + (heads x head dim x state size) SSM state
        m = shape.mamba
        conv = (m.conv_kernel - 1 + e.num_speculative_tokens) * m.conv_dim(e.tp) * shape.dtype_bytes
        return conv + (m.num_heads // e.tp) * m.head_dim * m.state_size * (
            e.ssm_dtype_bytes or m.ssm_dtype_bytes or shape.dtype_bytes)
    return None


def layout(shape: ModelShape, e: EngineShape) -> KvLayout:
    """Per-layer specs, hybrid block-size alignment, page unification and grouping."""
    notes: list[str] = []
    kv_b = kv_bytes_per_element(shape, e)
    # Per rank: heads are split across TP ranks, replicated when TP exceeds them.
    kv_heads_rank = max(1, shape.num_kv_heads // e.tp)
    replicated = e.tp > shape.num_kv_heads
    if replicated:
        notes.append(
            f"tensor parallel {e.tp} exceeds the {shape.num_kv_heads} KV heads: each head is replicated on "
            f"{e.tp // shape.num_kv_heads} ranks (decode context parallel removes this waste)"
        )
    if shape.mla_latent_dim:
        attn_per_token = shape.mla_latent_dim * kv_b  # one latent, no separate K and V
    else:
        attn_per_token = 2 * kv_heads_rank * shape.head_dim * kv_b

    block = e.block_size
    mamba_real = state_bytes(shape, e)
    mamba_pad_pct = None
    if mamba_real:
        # Platform._align_hybrid_block_size: the smallest aligned block whose page holds a state.
        align = max(e.kernel_block, e.block_size)
        attn_block = align * cdiv(mamba_real, int(align * attn_per_token))
        if block < attn_block:
            block = attn_block
            notes.append(f"attention block size raised to {block} tokens so one page holds a linear-attention state")
        page = int(block * attn_per_token)
        mamba_pad_pct = 100 * (page - mamba_real) / mamba_real
    page = int(block * attn_per_token)
    if page <= 0:
        raise ValueError("KV page size is zero: check the KV dtype and head dimensions")

    groups, group_size = _groups(_layer_specs(shape, e, page, block), notes)
    # _get_kv_cache_bytes_per_block (layer-outer): the widest group's pages (padding layers count).
    bytes_per_block = group_size * page
    return KvLayout(
        block_size=block,
        attn_page_per_token=attn_per_token,
        page_bytes=page,
        mamba_page_real=mamba_real,
        mamba_padding_pct=mamba_pad_pct,
        groups=groups,
        group_size=group_size,
        bytes_per_block=bytes_per_block,
        kv_heads_per_rank=kv_heads_rank,
        kv_heads_replicated=replicated,
        notes=tuple(notes),
    )


def _layer_specs(shape: ModelShape, e: EngineShape, page: int, block: int) -> list[LayerSpec]:
    """Every KV layer's spec, the model's in order, then the EAGLE/MTP draft's attention layers (they join
    the same pool as full-attention layers)."""
    specs: list[LayerSpec] = []
    for kind in shape.layer_kinds:
        if kind == "sliding":
            specs.append(LayerSpec("sliding", page, block, shape.sliding_window))
        elif kind == "chunked":
            specs.append(LayerSpec("chunked", page, block, chunk_size=shape.attention_chunk_size))
        else:
            specs.append(LayerSpec(kind, page, block))
    draft_kind: LayerKind = "mla" if shape.mla_latent_dim else "full"
    return specs + [LayerSpec(draft_kind, page, block)] * e.draft_layers


def _groups(layer_specs: list[LayerSpec], notes: list[str]) -> tuple[tuple[Group, ...], int]:
    """get_kv_cache_groups: one group when every layer needs the same slots, else
    _get_kv_cache_groups_uniform_page_size (bucket by type, equal-size groups, padding). Returns the groups
    and the group size."""
    buckets: dict[tuple, list[LayerSpec]] = {}
    for spec in layer_specs:
        key = (spec.kind if spec.kind != "mla" else "full", spec.sliding_window, spec.chunk_size)
        buckets.setdefault(key, []).append(spec)
    if len(buckets) == 1:
        (only,) = buckets.values()
        return (Group(only[0].kind, len(only), only[0]),), len(only)
    counts = [len(v) for v in buckets.values()]
    group_size = min(counts)
    if max(counts) < 1.5 * min(counts):
        group_size = max(counts)
    out = []
    for specs in buckets.values():
        n_groups = cdiv(len(specs), group_size)
        for i in range(n_groups):
            out.append(Group(specs[0].kind, len(specs[i::n_groups]), specs[0]))
        pad = n_groups * group_size - len(specs)
        if pad:
            notes.append(f"{pad} padding layer(s) added to the {specs[0].kind} groups")
    return tuple(out), group_size


def capacity(lay: KvLayout, e: EngineShape, pool_bytes: int) -> KvCapacity:
    """get_kv_cache_config_from_groups + get_max_concurrency_for_kv_cache_config + get_kv_cache_capacity."""
    if pool_bytes <= 0:
        raise ValueError(f"KV pool must be positive (got {pool_bytes} bytes)")
    num_blocks = pool_bytes // lay.bytes_per_block
    per_req = lay.blocks_per_request(e)
    conc = num_blocks / per_req
    legacy = num_blocks // len(lay.groups) * lay.block_size * e.dcp
    return KvCapacity(
        num_blocks=num_blocks,
        blocks_per_request=per_req,
        max_concurrency=conc,
        tokens_reported=int(conc * e.max_model_len),
        tokens_reported_legacy=legacy,
        pool_bytes=pool_bytes,
        used_bytes=num_blocks * lay.bytes_per_block,
    )


def pool_for_sessions(lay: KvLayout, e: EngineShape, sessions: int) -> int:
    """The smallest pool (bytes) in which `sessions` requests at max_model_len fit."""
    return lay.blocks_per_request(e) * sessions * lay.bytes_per_block
