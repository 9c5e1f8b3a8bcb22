"""kvbudget's figures against what the real vLLM CPU engine logs at startup, for three model shapes:
the embedded default (uniform full attention, through the appliance itself), a sliding-window model
a Gated DeltaNet hybrid and a Mamba2 hybrid (tiny random-weight models: `--load-format dummy`). The
vLLM probe's figures for the same command line are checked against the same log lines."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbudget import probe
from kvbudget.cpu import cpu_flags, has_avx512, isa_from_flags
from kvbudget.model_files import read_model
from kvbudget.plan_types import Platform, Targets
from kvbudget.planner import make_plan
from tests import loopback
from tests.support import RunningAppliance, default_model_path, free_port, shared_engine_cache, wait_for

pytestmark = pytest.mark.engine

ENGINE_LINE = re.compile(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
PADDING_LINE = re.compile(r"Padding mamba page size by ([\d.]+)%")

TINY = {
    "sliding-window": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128, "head_dim": 32,
                       "intermediate_size": 256, "vocab_size": 49152, "max_position_embeddings": 4096,
                       "sliding_window": 256, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2},
    "gated-deltanet-hybrid": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                              "num_hidden_layers": 8, "full_attention_interval": 4, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 128, "intermediate_size": 256,
                              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                              "shared_expert_intermediate_size": 64, "vocab_size": 49152,
                              "max_position_embeddings": 4096, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                              "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
                              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2},
    "mamba2-hybrid": {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                      "num_hidden_layers": 4, "layer_types": ["mamba", "mamba", "mamba", "attention"],
                      "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
                      "intermediate_size": 64, "shared_intermediate_size": 128, "num_local_experts": 4,
                      "num_experts_per_tok": 2, "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 64,
                      "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64,
                      "position_embedding_type": "nope", "vocab_size": 49152, "max_position_embeddings": 4096,
                      "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True},
}


def _start_engine(model: Path, args: list[str] | tuple[str, ...], log_path: Path) -> tuple[subprocess.Popen, int]:
    """A bare vLLM CPU server on loopback (no appliance), eager, offline, with the tests' shared compile cache
    and the planned pool winning over VLLM_CPU_KVCACHE_SPACE; its output goes to log_path. In a session of
    its own, so the test can kill its whole process group."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(shared_engine_cache()))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--enforce-eager", *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    return proc, port


def test_appliance_plan_matches_the_engine_log(appliance: RunningAppliance):
    log = appliance.log_text()
    m = ENGINE_LINE.search(log)
    assert m, "the engine logs its KV capacity"
    plan = loopback.get(f"{appliance.url}/v1/appliance/plan").json()
    assert plan["kv"]["kv_tokens_reported"] == int(m.group(1).replace(",", ""))
    assert f"{plan['kv']['max_concurrency']:.2f}" == m.group(3)
    assert plan["targets"]["context"] == int(m.group(2).replace(",", ""))
    # and the daemon said so in its own log before starting the engine
    assert f"{plan['kv']['kv_tokens_reported']:,} tokens, max concurrency {m.group(3)}" in log


@pytest.mark.parametrize("shape", list(TINY))
def test_tiny_models_match_the_engine_log(tmp_path: Path, shape: str):
    folder = tmp_path / shape
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY[shape]))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_path() / f, folder / f)
    # the engine runs on this host's real level, whatever KVBUDGET_HOST_CPU_ISA says
    isa = isa_from_flags(cpu_flags())
    plan = make_plan(read_model(folder), None, Targets(context=2048), Platform("cpu", enforce_eager=True, cpu_isa=isa),
                     kv_pool_bytes=256 << 20, max_num_seqs=8)
    log_path = tmp_path / "engine.log"
    proc, _ = _start_engine(folder, ["--load-format", "dummy", *plan.vllm_args], log_path)
    try:
        wait_for(lambda: ENGINE_LINE.search(log_path.read_text(errors="replace")) or proc.poll() is not None, 300,
                 interval=1, what="the engine's KV capacity line")
        text = log_path.read_text(errors="replace")
        m = ENGINE_LINE.search(text)
        assert m, text[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert int(m.group(1).replace(",", "")) == plan.capacity.tokens_reported
    assert m.group(3) == f"{plan.capacity.max_concurrency:.2f}"
    # vLLM's own figures for the same command line, from the probe (meta device, no engine), equal the log too
    vllm = probe.ask(folder, plan.vllm_args, probe.cpu_host(isa))
    assert vllm.kv_tokens == int(m.group(1).replace(",", ""))
    assert m.group(3) == f"{vllm.max_concurrency:.2f}"
    if plan.layout.mamba_page_real:
        pad = PADDING_LINE.search(text)
        assert pad and pad.group(1) == f"{plan.layout.mamba_padding_pct:.2f}"


def test_fp8_kv_cache_follows_this_host(tmp_path: Path):
    """FP8 KV on the real CPU engine, with the embedded default model: from AVX-512 on the plan chooses it,
    the engine allocates the KV tokens the plan says (twice the model dtype's) and still answers; on an AVX2
    host the plan falls back to the model dtype, and the engine asked for FP8 refuses in vLLM's words. The
    host's real level decides (KVBUDGET_HOST_CPU_ISA does not reach the engine)."""
    isa = isa_from_flags(cpu_flags())
    folder = default_model_path()
    plan = make_plan(read_model(folder), None, Targets(context=2048, kv_dtype="fp8"),
                     Platform("cpu", enforce_eager=True, cpu_isa=isa), kv_pool_bytes=1 << 30, max_num_seqs=8)
    args = plan.vllm_args if plan.engine.kv_dtype == "fp8" else (*plan.vllm_args, "--kv-cache-dtype", "fp8")
    log_path = tmp_path / "engine.log"
    proc, port = _start_engine(folder, ["--served-model-name", "default", *args], log_path)
    try:
        if not has_avx512(isa):
            assert plan.engine.kv_dtype == "auto" and any("AVX-512 or AMX" in n for n in plan.notes), plan.notes
            wait_for(lambda: proc.poll() is not None, 300, interval=1, what="the engine to refuse FP8 KV")
            assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in log_path.read_text(errors="replace")
            return
        assert plan.engine.kv_dtype == "fp8" and "--kv-cache-dtype" in plan.vllm_args
        wait_for(lambda: proc.poll() is not None or b"Application startup complete" in log_path.read_bytes(), 300,
                 interval=1, what="the engine with FP8 KV to start")
        text = log_path.read_text(errors="replace")
        m = ENGINE_LINE.search(text)
        assert proc.poll() is None and m, text[-3000:]
        assert int(m.group(1).replace(",", "")) == plan.capacity.tokens_reported
        bf16 = make_plan(read_model(folder), None, Targets(context=2048, kv_dtype="bf16"), Platform("cpu", cpu_isa=isa),
                         kv_pool_bytes=1 << 30, max_num_seqs=8)
        assert plan.capacity.tokens_reported >= 2 * bf16.capacity.tokens_reported - bf16.layout.block_size
        r = loopback.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "default", "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
