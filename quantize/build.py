"""One quantized build: a scheme's settings chosen for the model, LLM Compressor run in its own
environment (quantize/worker.py), the result checked, described (build.json), pinned and moved into place
in one rename, so a half-written build is never where a configuration points."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from kernels.manifest import build as manifest_of
from quantize.calibration import Calibration

WORKER = Path(__file__).with_name("worker.py")
BUILD_FILE = "build.json"


@dataclass(frozen=True)
class Scheme:
    name: str
    preset: str  # compressed-tensors' preset scheme
    algorithm: str  # "gptq" (calibrated, error-correcting) or "rtn" (round to nearest, no data)
    grouped: bool  # 4-bit weights in groups of columns, the group chosen from the model's shapes
    runs_on: str


SCHEMES = {
    "w8a8-int8": Scheme("w8a8-int8", "W8A8", "gptq", False,
                        "8-bit integer weights per channel and 8-bit activations per token, quantized as the "
                        "engine runs: the CPU build with VNNI or AMX (oneDNN), and GPUs"),
    "w4a16": Scheme("w4a16", "W4A16", "gptq", True,
                    "4-bit integer weights in groups, 16-bit activations: the CPU build (its WNA16 kernel wants "
                    "layer sizes in multiples of 32) and GPUs"),
    "fp8-dynamic": Scheme("fp8-dynamic", "FP8_DYNAMIC", "rtn", False,
                          "FP8 weights per channel and FP8 activations per token, no calibration: GPUs with FP8 "
                          "(compute capability 8.9 and up); the CPU build has no usable FP8 matrix kernel"),
}
_GROUPS = (128, 64, 32)


class BuildError(RuntimeError):
    """The build was not made; nothing was written where it was to go. The message says why."""


@dataclass(frozen=True)
class Built:
    folder: Path
    digest: str
    total_bytes: int
    description: dict


def group_size(config: dict) -> int:
    """The largest group of columns (128, 64 or 32) that divides every linear layer's input: the hidden
    size (q, k, v, gate, up), the attention output (heads x head dim) and the MLP's inner size (down)."""
    cfg = config.get("text_config") or config
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    sizes = {hidden, heads * int(cfg.get("head_dim") or hidden // heads)}
    sizes |= {int(cfg[k]) for k in ("intermediate_size", "moe_intermediate_size") if isinstance(cfg.get(k), int)}
    for g in _GROUPS:
        if all(s % g == 0 for s in sizes):
            return g
    raise BuildError(f"no 4-bit group fits this model's layer sizes {sorted(sizes)}: each must be a multiple of "
                     f"32 (vLLM's CPU kernel needs that too); choose w8a8-int8")


def _source_config(source: Path) -> dict:
    path = source / "config.json"
    if not path.is_file():
        raise BuildError(f"{source} is not a model folder: it has no config.json")
    config = json.loads(path.read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise BuildError(f"{source} is already quantized ({method}); quantize its unquantized (BF16/FP16) build")
    return config


def _spec(source: Path, out: Path, scheme: Scheme, config: dict, conversations: Path | None,
          samples: int, max_seq_length: int) -> dict:
    return {"source": str(source), "out": str(out), "preset": scheme.preset, "algorithm": scheme.algorithm,
            "group_size": group_size(config) if scheme.grouped else None, "ignore": ["lm_head"],
            "calibration": {"conversations": str(conversations) if conversations else None, "samples": samples,
                            "max_seq_length": max_seq_length}}


def _run_worker(python: Path, spec: dict, work: Path, log: Path) -> dict:
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with log.open("a") as err:
        done = subprocess.run([str(python), "-I", str(WORKER), str(spec_path)], stdout=subprocess.PIPE,
                              stderr=err, text=True, env=env, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BuildError(f"LLM Compressor failed (exit {done.returncode}); its output is in {log}")
    return json.loads(lines[-1])


def _check_output(folder: Path) -> str:
    """kvbudget's own reading of the build's quantization (what the plan and the engine will see)."""
    from kvbudget.model_files import read_model_folder

    try:
        weight_format = read_model_folder(folder).weight_format
    except Exception as e:  # a build kvbudget cannot read is not one to move into place
        raise BuildError(f"the build in {folder} cannot be read as a model: {e}") from None
    if not weight_format:
        raise BuildError(f"the build in {folder} has no quantization config; LLM Compressor wrote an unquantized model")
    return weight_format


def _describe(source: Path, scheme: Scheme, spec: dict, calibration: Calibration | None, tools: dict,
              weight_format: str) -> dict:
    cal = None
    if calibration is not None:
        cal = {"source": calibration.source, "items": len(calibration.items), "samples": spec["calibration"]["samples"],
               "max_seq_length": spec["calibration"]["max_seq_length"],
               "sha256": sha256(calibration.jsonl().encode()).hexdigest()}
    return {"scheme": scheme.name, "preset": scheme.preset, "algorithm": scheme.algorithm,
            "group_size": spec["group_size"], "ignore": spec["ignore"], "weight_format": weight_format,
            "runs_on": scheme.runs_on, "source": {"path": str(source), "digest": manifest_of(source).digest},
            "calibration": cal, "tools": tools["tools"], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# A quality gate: given the source and the finished build, what it measured (kept in build.json), or a
# BuildError when the build loses more than its bound (quantize.compare.gate).
Gate = Callable[[Path, Path], dict]


def quantize(source: Path, out: Path, scheme: Scheme, *, python: Path, calibration: Calibration | None,
             samples: int = 64, max_seq_length: int = 512, log: Path, force: bool = False,
             gate: Gate | None = None) -> Built:
    """Quantize source into out. The build is made in a hidden folder beside out and renamed into place
    only once it reads as a quantized model, passed the gate, and carries its build.json and pin."""
    from appliance.boot import model_pin

    source, out = source.resolve(), out.absolute()
    config = _source_config(source)
    if out.exists() and not force:
        raise BuildError(f"{out} exists; choose another --out or pass --force to replace it")
    if scheme.algorithm == "gptq" and calibration is None:
        raise BuildError(f"{scheme.name} is calibrated (GPTQ): it needs calibration conversations")
    if scheme.algorithm != "gptq":
        calibration = None  # round to nearest reads no data: none is written, none described
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="appliance-quantize-") as work_dir:
            work = Path(work_dir)
            conversations = None
            if calibration is not None:
                conversations = work / "calibration.jsonl"
                conversations.write_text(calibration.jsonl())
            spec = _spec(source, partial, scheme, config, conversations, samples, max_seq_length)
            tools = _run_worker(python, spec, work, log)
        weight_format = _check_output(partial)
        for f in partial.iterdir():  # torch writes the weights 0600; the engine runs as another user
            f.chmod(0o644)
        description = _describe(source, scheme, spec, calibration, tools, weight_format)
        description["gate"] = gate(source, partial) if gate is not None else None
        (partial / BUILD_FILE).write_text(json.dumps(description, indent=2) + "\n")
        manifest = model_pin.pin(partial)
        _move_into_place(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Built(out, manifest.digest, manifest.total_bytes, description)


def read_description(folder: Path) -> dict | None:
    """The build.json of a folder this module built, or None (any other model folder)."""
    try:
        described = json.loads((Path(folder) / BUILD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return described if isinstance(described, dict) else None


def _move_into_place(partial: Path, out: Path) -> None:
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)
