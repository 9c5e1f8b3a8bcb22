"""`appliance plan` and `appliance gpus` as an operator runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbudget.gpu import discover
from tests.support import REPO

FIX = REPO / "tests" / "fixtures" / "models"
SEED = str(FIX / "qwen3.6-27b-fp8.json")
PRO6000 = "RTX PRO 6000 Blackwell"


# Most tests here are about the plan's content, which the kvbudget model and vLLM agree on (the cross-check in
# tests/integration/test_kvbudget_vs_vllm.py): they pass --model-only and skip vLLM's import (about 10 s).
# The blueprint audit and test_plan_names_its_source ask vLLM as an operator's plan does.


def appliance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance.cli", *args], capture_output=True, text=True, timeout=120)


def test_seed_audit_reproduces_the_per_token_figures_and_explains_the_gap():
    r = appliance("plan", "--model", SEED, "--gpu", PRO6000, "--sessions", "50", "--context", "32768")
    out = r.stdout
    assert r.returncode == 1, "50 sessions at 32k do not fit: the blueprint is optimistic"
    assert "65,536 B in the model dtype, 32,768 B in FP8 (16 of 64 layers keep KV)" in out
    assert "97,887 MiB are 102.64 GB but 95.59 GiB" in out  # GB vs GiB
    assert "holds back 8%" in out  # vLLM's reserve
    assert "linear-attention state: every sequence also holds" in out and "align mode" in out
    assert "block granularity: 1568-token blocks" in out
    assert "TARGETS NOT MET" in out and "sessions: wanted 50 sessions at 32,768 tokens" in out
    assert "--kv-cache-dtype fp8" in out and "--mamba-cache-mode align" in out
    assert "Traceback" not in r.stderr


def test_json_plan_for_machines():
    r = appliance("plan", "--model-only", "--model", SEED, "--gpu", PRO6000, "--sessions", "20", "--context", "32768", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["fits"] and p["targets_met"]
    assert p["kv"]["per_token_kv_bytes"] == 32_768 and p["kv"]["block_size"] == 1568
    m = p["memory_bytes"]
    assert m["kv_pool"] % p["kv"]["bytes_per_block"] == 0
    args = p["vllm_args"]
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(m["kv_pool"])
    assert args[args.index("--max-num-seqs") + 1] == "20"
    assert set(p["sessions_at_context"]) >= {"4096", "32768", "131072"}


def test_model_that_does_not_fit_at_all():
    r = appliance("plan", "--model-only", "--model", str(FIX / "qwen3.5-397b-a17b.json"), "--gpu", PRO6000)
    assert r.returncode == 1
    assert "DOES NOT FIT" in r.stdout and "weights alone are" in r.stdout and "GB per GPU" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", str(FIX / "not-a-causal-lm.json"), "--gpu", PRO6000], "not a causal language model"),
        (["--model", str(FIX / "missing.json"), "--gpu", PRO6000], "does not exist"),
        (["--model", SEED, "--gpu", "Voodoo 2"], "unknown GPU 'Voodoo 2'; known: RTX PRO 6000 Blackwell"),
        (["--model", SEED, "--gpu-memory", "0"], "must be positive"),
        (["--model", SEED, "--gpu-memory", "-5GiB"], "is not a size"),
        (["--model", SEED, "--gpu", "RTX A6000", "--kv-dtype", "fp8"], "compute capability 8.9"),
        (["--model", SEED, "--gpu", PRO6000, "--sessions", "0"], "Invalid value for '--sessions'"),
        (["--model", SEED, "--cpu"], "give the KV pool size"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args, message, tmp_path):
    r = appliance("plan", "--model-only", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr


def test_missing_fields_are_named(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}))
    r = appliance("plan", "--model-only", "--model", str(f), "--gpu", PRO6000)
    assert r.returncode == 2 and "num_attention_heads" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(discover().found, reason="this machine has an NVIDIA GPU")
def test_without_nvml_discovery_says_so_and_named_gpus_still_plan():
    d = discover()
    assert not d.found and d.error.startswith("no NVIDIA driver")
    r = appliance("gpus")
    assert r.returncode == 1 and "no NVIDIA driver" in r.stdout
    r = appliance("gpus", "--json")
    assert json.loads(r.stdout)["error"].startswith("no NVIDIA driver")
    r = appliance("plan", "--model-only", "--model", SEED)
    assert r.returncode == 2 and "no NVIDIA driver" in r.stderr and "--gpu" in r.stderr
    assert appliance("plan", "--model-only", "--model", SEED, "--gpu", PRO6000).returncode == 0


def test_cpu_backend_plan_with_explicit_pool():
    base = ("plan", "--model-only", "--model", str(FIX / "llama-3.1-8b.json"), "--cpu", "--kv-pool", "1GiB",
            "--context", "2048", "--json")
    p = json.loads(appliance(*base).stdout)
    assert p["platform"] == "cpu" and p["kv"]["block_size"] == 128
    # this host's level decides the KV dtype under auto: FP8 from AVX-512 on, the model dtype below, both said
    from kvbudget.cpu import has_avx512, host_isa

    assert ("--kv-cache-dtype" in p["vllm_args"]) == has_avx512(host_isa()) == (p["kv"]["kv_dtype"] == "fp8")
    assert p["kv"]["kv_dtype_why"] and host_isa() in p["kv"]["kv_dtype_why"]
    for isa, dtype in (("avx2", "auto"), ("avx512", "fp8")):
        other = json.loads(appliance(*base, "--cpu-isa", isa).stdout)
        assert other["kv"]["kv_dtype"] == dtype and other["cpu_isa"] == isa


def test_plan_names_its_source_and_plans_prefix_caching_off():
    """With vLLM installed here the plan follows vLLM's figures; --model-only keeps the model's; an engine
    interpreter without vLLM falls back to the model and says why."""
    base = ("plan", "--model", str(FIX / "qwen3.6-27b.json"), "--gpu", PRO6000, "--context", "32768", "--json")
    asked = json.loads(appliance(*base).stdout)
    assert asked["source"].startswith("vllm ") and asked["vllm"]["platform"].startswith("cuda (emulated")
    assert "disagreements" not in asked, asked.get("disagreements")
    alone = json.loads(appliance(*base, "--model-only").stdout)
    assert alone["source"] == "kvbudget model" and "vllm" not in alone
    assert alone["kv"]["max_concurrency"] == pytest.approx(asked["kv"]["max_concurrency"])
    off = json.loads(appliance(*base, "--prefix-caching", "off", "--model-only").stdout)
    assert "--no-enable-prefix-caching" in off["vllm_args"]
    assert off["vllm_args"][off["vllm_args"].index("--mamba-cache-mode") + 1] == "none"
    assert off["kv"]["max_concurrency"] > alone["kv"]["max_concurrency"]  # one state block per sequence, not two
    assert any("prefix caching costs sessions" in n for n in alone["notes"])
    no_vllm = json.loads(appliance(*base, "--engine-python", "/usr/bin/python3").stdout)
    assert no_vllm["source"] == "kvbudget model"
    assert any("figures from the kvbudget model only" in n for n in no_vllm["notes"])


def test_cpu_plan_names_its_host_and_takes_another():
    """--cpu plans for this host's instruction set; --cpu-isa for another (the MLA fixture's block size and
    prefix caching follow AMX)."""
    model = str(FIX / "deepseek-v2-lite-chat.json")
    amx = appliance("plan", "--model-only", "--model", model, "--cpu", "--cpu-isa", "amx", "--kv-pool", "4GiB", "--json")
    avx2 = appliance("plan", "--model-only", "--model", model, "--cpu", "--cpu-isa", "avx2", "--kv-pool", "4GiB", "--json")
    assert amx.returncode == 0 and avx2.returncode == 0, amx.stderr + avx2.stderr
    a, b = json.loads(amx.stdout), json.loads(avx2.stdout)
    assert (a["cpu_isa"], a["kv"]["block_size"]) == ("amx", 128) and (b["cpu_isa"], b["kv"]["block_size"]) == ("avx2", 16)
    here = appliance("plan", "--model-only", "--model", model, "--cpu", "--kv-pool", "4GiB")
    from kvbudget.cpu import host_isa

    assert f"the CPU backend ({host_isa()} host, fixed KV pool)" in here.stdout
    r = appliance("plan", "--model-only", "--model", model, "--cpu-isa", "amx", "--gpu", PRO6000)
    assert r.returncode == 2 and "--cpu-isa plans for the CPU backend" in r.stderr
    r = appliance("plan", "--model-only", "--model", model, "--cpu", "--cpu-isa", "avx1024", "--kv-pool", "1GiB")
    assert r.returncode == 2 and "avx1024" in r.stderr and "Traceback" not in r.stderr
