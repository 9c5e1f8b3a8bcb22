"""Weight precision in the plan (kvbudget.weights): vLLM's load-time FP8 on a 16-bit checkpoint, chosen under
`auto` only where it fits what would not fit or buys enough sessions, refused where vLLM cannot run it.
vLLM's own acceptance and refusal of the same command lines: tests/integration/test_kvbudget_vs_vllm.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbudget import weights
from kvbudget.model_files import read_model
from kvbudget.plan_types import PlanError, Platform, Targets
from kvbudget.planner import make_plan
from kvbudget.profiles import custom_profile, find_profile
from kvbudget.render import plan_dict, plan_text
from tests.support import REPO

FIX = REPO / "tests" / "fixtures" / "models"
GiB = 1 << 30


def model(name: str):
    return read_model(FIX / f"{name}.json")


def quantization_args(args: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(a, args[i + 1]) for i, a in enumerate(args) if a == "--quantization"]


def test_fp8_weights_keep_the_embeddings_and_halve_the_rest():
    m = model("llama-3.1-8b")  # untied: embed_tokens and lm_head, 128,256 x 4,096 each, in bf16
    embed = 2 * 128_256 * 4_096 * 2
    assert weights.embedding_bytes(m) == embed
    assert weights.fp8_bytes(m) == embed + (m.weight_bytes - embed) // 2
    tied = model("smollm2-135m-instruct")
    assert weights.embedding_bytes(tied) == tied.vocab_size * tied.hidden_size * 2


def test_a_bf16_27b_on_an_l40s_is_planned_with_fp8_weights():
    """The product's anchor model, 54 GB in BF16, on a 48 GB card: vLLM serves it with --quantization fp8."""
    m, card = model("qwen3.6-27b"), find_profile("L40S")
    stored = make_plan(m, card, Targets(weights="model"))
    assert not stored.fits and stored.findings[0].target == "fit" and stored.vllm_args == ()
    assert stored.weights.alternative.startswith('FP8 at load (targets.weights = "fp8"): 9.4 sessions at 32,768')
    p = make_plan(m, card, Targets())
    assert p.fits and p.weights is not None and p.weights.scheme == "fp8"
    assert quantization_args(p.vllm_args) == [("--quantization", "fp8")]
    assert p.memory.weights == weights.fp8_bytes(m) < m.weight_bytes * 0.6
    # the pool follows the weights: what FP8 saved is KV (same headroom and reserve)
    assert p.memory.kv_pool + p.memory.unused == int(card.memory_bytes * 0.92) - p.memory.weights - p.memory.reserve
    assert "do not fit" in p.weights.reason and p.weights.quality and "no calibration" in p.weights.quality
    assert p.weights.alternative and 'targets.weights = "model"' in p.weights.alternative


def test_auto_takes_fp8_only_when_it_buys_the_asked_share_of_sessions():
    m, card = model("qwen3.6-27b"), find_profile("H100 80GB")  # fits either way on 80 GB
    stored = make_plan(m, card, Targets(weights="model"))
    small = make_plan(m, card, Targets(weights="fp8"))
    gain = small.capacity.max_concurrency / stored.capacity.max_concurrency - 1
    assert gain > 0.25
    assert small.weights.alternative == (f'16-bit weights (targets.weights = "model"): '
                                         f'{stored.capacity.max_concurrency:.1f} sessions at 32,768 tokens, '
                                         f'{stored.memory.weights / 1e9:.1f} GB of weights per GPU')
    taken = make_plan(m, card, Targets())
    assert taken.weights.scheme == "fp8" and taken.vllm_args == small.vllm_args
    assert f"{small.capacity.max_concurrency:.1f} sessions" in taken.weights.reason
    kept = make_plan(m, card, Targets(fp8_weights_gain=gain + 0.01))
    assert kept.weights.scheme == "model" and not quantization_args(kept.vllm_args)
    assert kept.vllm_args == stored.vllm_args and kept.memory == stored.memory
    assert kept.weights.alternative and f"{small.capacity.max_concurrency:.1f} sessions" in kept.weights.alternative
    tiny = make_plan(model("smollm2-135m-instruct"), card, Targets())  # 0.3 GB of weights: nothing to gain
    assert tiny.weights.scheme == "model" and "less than the 25%" in tiny.weights.reason


def test_a_card_without_fp8_keeps_the_checkpoint_unless_asked():
    m, card = model("llama-3.1-8b"), find_profile("A100 80GB")  # 8.0: vLLM's Marlin runs FP8 weight-only
    p = make_plan(m, card, Targets())
    assert p.weights.scheme == "model" and "no FP8 tensor cores" in p.weights.reason
    asked = make_plan(m, card, Targets(weights="fp8"))
    assert quantization_args(asked.vllm_args) == [("--quantization", "fp8")]
    assert "weight-only (Marlin)" in asked.weights.quality


@pytest.mark.parametrize("case, message", [
    ("cpu", "CPU build cannot quantize weights to FP8"),
    ("quantized", "not a 16-bit checkpoint"),
    ("volta", "compute capability 7.5 or newer"),
])
def test_fp8_weights_are_refused_where_vllm_cannot_run_them(case, message):
    if case == "cpu":
        args = (model("llama-3.1-8b"), None, Targets(weights="fp8"), Platform("cpu", cpu_isa="amx"))
        kw = {"kv_pool_bytes": GiB}
    elif case == "quantized":
        args = (model("qwen3.6-27b-fp8"), find_profile("L40S"), Targets(weights="fp8"), Platform())
        kw = {}
    else:
        args = (model("llama-3.1-8b"), custom_profile(32 * GiB, (7, 0), "V100"), Targets(weights="fp8"), Platform())
        kw = {}
    with pytest.raises(PlanError, match=message):
        make_plan(*args, **kw)
    auto = make_plan(*args[:2], replace(args[2], weights="auto"), args[3], **kw)
    assert auto.weights.scheme == "model" and not quantization_args(auto.vllm_args)
    if case == "volta":  # auto says why in vLLM's terms, not as if FP8 could be asked for there
        assert "Minimum capability: 75" in auto.weights.reason and "weight-only" not in auto.weights.reason


def test_a_fixed_pool_keeps_the_checkpoint():
    p = make_plan(model("qwen3.6-27b"), find_profile("H100 80GB"), Targets(), kv_pool_bytes=8 * GiB)
    assert p.weights.scheme == "model" and "the KV pool is fixed" in p.weights.reason


def test_the_plan_shows_its_weights():
    p = make_plan(model("qwen3.6-27b"), find_profile("L40S"), Targets())
    text = plan_text(p)
    assert "Weights: FP8, quantized by vLLM at load (--quantization fp8)" in text and "(FP8 at load)" in text
    d = plan_dict(p)["weights"]
    assert d["scheme"] == "fp8" and d["vllm_args"] == ["--quantization", "fp8"] and d["bytes"] == p.memory.weights
    stored = plan_dict(make_plan(model("llama-3.1-8b"), find_profile("A100 80GB"), Targets()))["weights"]
    assert stored["scheme"] == "model" and stored["vllm_args"] == [] and stored["alternative"] is None
