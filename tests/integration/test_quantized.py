"""Quantized builds for real (issue 32): `appliance model quantize` makes each scheme vLLM's CPU build runs
from the embedded default (LLM Compressor in its own environment, the shipped calibration set; for
w8a8-int8, the scheme make run serves, through its quality gate), and the appliance serves it pinned
through the real engine, which picks the scheme's CPU kernel and answers. The
plan's weight bytes are compared with the checkpoint size vLLM logs loading it. A mislabeled copy of a
build is refused at start, before any engine runs.

One appliance at a time: the builds are served one after the other (the fixture is parametrized by
scheme), so the module never holds two engines."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbudget.cpu import cpu_flags, has_avx512, isa_from_flags
from tests import loopback
from tests.support import REPO, default_model_path, start_appliance, write_config

pytestmark = pytest.mark.engine

# The kernel vLLM 0.32's CPU build logs choosing for each scheme's layers.
KERNEL = {"w8a8-int8": "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8",
          "w4a16": "Using CPUWNA16LinearKernel for CompressedTensorsWNA16"}
CHECKPOINT_LINE = re.compile(r"Checkpoint size: ([\d.]+) GiB")


def quantize_env() -> Path:
    """Kept between runs, like the engine's compile cache: only the first run installs LLM Compressor."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "appliance" / "test-quantize-env"


def quantize(out: Path, scheme: str, *options: str) -> tuple[str, str]:
    run = subprocess.run([sys.executable, "-m", "appliance.cli", "model", "quantize", str(default_model_path()),
                          "--scheme", scheme, "--out", str(out), *options], cwd=REPO, capture_output=True,
                         text=True, timeout=1200, env=dict(os.environ, APPLIANCE_QUANTIZE_ENV=str(quantize_env())))
    log = out.parent / f"{out.name}.quantize.log"
    assert run.returncode == 0, run.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    return run.stdout.strip().splitlines()[-1], run.stderr


@pytest.fixture(scope="module", params=sorted(KERNEL))
def served(request, tmp_path_factory):
    scheme = request.param
    work = tmp_path_factory.mktemp(f"quantized-{scheme}")
    build = work / f"smollm2-{scheme}"
    # The gate (the engine answering the shipped questions with the source and the build) on the scheme
    # make run serves, with make run's bound; the other placed without it, to keep the suite's time.
    digest, said = quantize(build, scheme, *(("--max-loss", "0.10") if scheme == "w8a8-int8" else ("--no-gate",)))
    assert ("gate passed" in said) == (scheme == "w8a8-int8"), said
    app = start_appliance(work / "app", model=build, model_extra=f'digest = "{digest}"')
    try:
        app.wait_ready()
        yield scheme, build, digest, app
    finally:
        app.stop()


def test_the_build_says_what_it_is_and_matches_its_pin(served):
    scheme, build, digest, app = served
    described = json.loads((build / "build.json").read_text())
    assert described["scheme"] == scheme and described["calibration"]["source"] == "shipped"
    assert described["tools"]["llmcompressor"] == "0.14.0" and described["source"]["digest"].startswith("sha256:")
    assert (scheme == "w4a16") == (described["group_size"] == 64)  # 576 columns: groups of 128 do not fit
    if scheme == "w8a8-int8":  # what the gate measured, kept with the build
        gate = described["gate"]
        assert gate["questions"] >= 40 and gate["loss"] <= gate["max_loss"] == 0.10 and gate["accuracy_source"] > 0.3
    quant = json.loads((build / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    status = loopback.get(f"{app.url}/v1/appliance/status").json()
    assert status["model"]["digest"] == digest and status["model"]["matches_pin"] is True, status["model"]
    held = status["model"]["weights"]
    assert (held["format"], held["scheme"]) == (quant["quant_method"] + "/" + quant["format"], scheme), held
    assert held["quantized_at_load"] is None and held["why"] == "the checkpoint's own weights", held
    # the KV dtype make run's plan takes on this host, and why: FP8 from AVX-512 on, the model dtype below
    fp8 = has_avx512(isa_from_flags(cpu_flags()))
    plan = status["plan"]
    assert plan["kv_cache_dtype"] == ("fp8" if fp8 else "model dtype"), plan
    assert ("twice the tokens" if fp8 else "needs AVX-512 or AMX") in plan["kv_cache_dtype_why"], plan
    assert ("--kv-cache-dtype fp8" in app.log_text()) == fp8


def test_the_engine_runs_the_scheme_s_cpu_kernel_and_answers(served):
    """The build still knows what the bf16 model knows: its greedy next word, with the margin the bf16 build
    has (top-1 by 2 nats there). A whole chat answer is a poorer check on a model this small: one early
    token that quantization tips (a reply opened in French) changes all that follows; agreement over many
    answers is what `appliance model compare` measures."""
    scheme, _, _, app = served
    assert KERNEL[scheme] in app.log_text()
    for prompt, word in (("The capital of France is", " Paris"), ("The opposite of hot is", " cold")):
        r = loopback.post(f"{app.url}/v1/completions", timeout=120, json={
            "model": app.served_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5})
        assert r.status_code == 200, r.text
        top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        assert max(top, key=top.get) == word, (prompt, top)
    r = loopback.post(f"{app.url}/v1/chat/completions", timeout=120, json={
        "model": app.served_name, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is 2 + 3?"}]})
    assert r.status_code == 200 and "5" in r.json()["choices"][0]["message"]["content"], r.text


def test_the_plan_s_weight_bytes_are_what_vllm_loads(served):
    scheme, build, _, app = served
    plan = loopback.get(f"{app.url}/v1/appliance/plan").json()
    assert plan["model"]["weight_format"] == json.loads((build / "build.json").read_text())["weight_format"]
    logged = CHECKPOINT_LINE.search(app.log_text())
    assert logged, "vLLM logs the checkpoint's size as it loads it"
    assert f"{plan['memory_bytes']['weights'] / (1 << 30):.2f}" == logged.group(1), (plan["memory_bytes"], scheme)


def test_a_mislabeled_copy_is_refused_at_start(served, tmp_path: Path):
    """Another scheme's config.json in the folder (pinned again, so the pin passes): start-up names the
    folder and what is wrong before an engine is started."""
    scheme, build, _, _ = served
    copy = tmp_path / "mislabeled"
    shutil.copytree(build, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["format"] = "int-quantized" if scheme == "w4a16" else "pack-quantized"
    (copy / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--config",
                          str(write_config(tmp_path / "app", model=copy))], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "mislabeled" in run.stderr and str(copy) in run.stderr, run.stderr[-2000:]
