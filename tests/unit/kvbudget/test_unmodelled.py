"""The kvbudget model is never confidently wrong: a config whose cache-holding layers it does not read
(state-space, convolution, shared-block or layer-kind settings) is refused when planned without vLLM, naming
what it did not understand. tests/fixtures/unmodelled/ holds such configs, made by transformers' own config
classes (Jamba, Zamba2, Bamba, LFM2, MiniMax-Text, RecurrentGemma, Gemma 3n); with vLLM's probe the same
plans follow vLLM (tests/integration/test_kvbudget_vs_vllm.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbudget.model import shape_from_config
from kvbudget.model_files import read_model
from kvbudget.plan_types import PlanError, Platform, Targets
from kvbudget.planner import make_plan, require_modelled
from kvbudget.profiles import find_profile

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
UNMODELLED = sorted((FIXTURES / "unmodelled").glob("*.json"))
MODELLED = sorted(p for p in (FIXTURES / "models").glob("*.json") if p.stem != "not-a-causal-lm")


@pytest.mark.parametrize("path", UNMODELLED, ids=[p.stem for p in UNMODELLED])
def test_unread_layer_settings_refuse_a_model_only_plan(path: Path):
    model = read_model(path)
    assert model.unmodelled, f"{path.stem}: nothing flagged"
    plan = make_plan(model, find_profile("L40S"), Targets(context=4096), Platform("gpu"))  # the plan is made...
    with pytest.raises(PlanError) as refused:  # ...and refused when nothing but the model would stand behind it
        require_modelled(plan)
    text = str(refused.value)
    assert all(item in text for item in model.unmodelled) and "vLLM's probe" in text and "--model-only" in text


@pytest.mark.parametrize("path", MODELLED, ids=[p.stem for p in MODELLED])
def test_every_modelled_fixture_is_understood(path: Path):
    assert read_model(path).unmodelled == ()


def test_what_is_flagged_is_what_was_not_read():
    base = {"architectures": ["XForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256,
            "vocab_size": 1000, "max_position_embeddings": 4096}
    assert shape_from_config(base).unmodelled == ()
    # A state setting without any state layer derived, and a layer plan kvbudget never reads
    s = shape_from_config({**base, "mamba_d_state": 16, "attn_layer_period": 2, "ssm_cfg": None})
    assert s.unmodelled == ("mamba_d_state", "attn_layer_period")
    # layer_types entries it does not know are planned as attention and named
    s = shape_from_config({**base, "layer_types": ["conv", "full_attention", "conv", "full_attention"]})
    assert s.unmodelled == ("layer_types entry 'conv'",) and s.layer_kinds == ("full",) * 4
    # Gated DeltaNet layers it derives carry their state settings: nothing flagged
    gdn = {**base, "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
           "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
           "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32"}
    assert shape_from_config(gdn).unmodelled == ()
    # the same layer kind without Gated DeltaNet's settings is another recurrent state: named, not an error
    other = {k: v for k, v in gdn.items() if not k.startswith("linear_")}
    assert shape_from_config(other).unmodelled[0].startswith("layer_types entry 'linear_attention' (not Gated DeltaNet")


def test_cli_model_only_refuses_and_names_the_settings():
    path = FIXTURES / "unmodelled" / "jamba-tiny.json"
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "plan", "--model-only", "--model", str(path),
                        "--gpu", "L40S"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "attn_layer_period" in r.stderr and "mamba_d_state" in r.stderr and "vLLM's probe" in r.stderr


def test_without_an_engine_environment_the_plan_is_refused_not_guessed(tmp_path):
    """No vLLM to ask (engine.python names nothing runnable): a modelled config plans on the model's figures
    and says so; an unmodelled one is refused with the reason the probe could not be asked."""
    from appliance.boot.planning import with_vllm_figures
    from kvbudget import probe

    l40s = find_profile("L40S")
    device = probe.Device("cuda", l40s.compute_capability, l40s.name, l40s.memory_bytes)
    good = FIXTURES / "models" / "llama-3.1-8b.json"
    plan = with_vllm_figures(make_plan(read_model(good), l40s, Targets(context=4096), Platform("gpu")), good, device,
                             str(tmp_path / "no-python"))
    assert any("kvbudget model only" in n for n in plan.notes)
    jamba = FIXTURES / "unmodelled" / "jamba-tiny.json"
    with pytest.raises(PlanError, match=r"attn_layer_period.*not an executable interpreter"):
        with_vllm_figures(make_plan(read_model(jamba), l40s, Targets(context=4096), Platform("gpu")), jamba, device,
                          str(tmp_path / "no-python"))


def test_fixtures_are_real_configs():
    for path in UNMODELLED:
        cfg = json.loads(path.read_text())
        assert cfg["architectures"][0].endswith("ForCausalLM") and cfg.get("model_type"), path.stem
