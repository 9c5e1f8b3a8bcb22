"""Does a model folder's config say what its weights are? Read from the safetensors headers alone (names
and dtypes, a few kilobytes per file, no tensor read), before any engine is started.

A quantized build whose config.json lost its quantization_config (or a config copied from another build)
makes vLLM fail deep inside its weight loader, minutes into a start, with a shape error that names no
file; a header that does not parse is a corrupted or truncated download. Both are caught here, at start,
in words an operator can act on.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# Tensor names only a quantized checkpoint has (compressed-tensors, GPTQ, AWQ and FP8 checkpoints).
_QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "input_scale", "qweight", "qzeros",
                       "scales", "weight_scale_inv")
_QUANTIZED_DTYPES = {"I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}
# What a compressed-tensors format must hold: (what to look for, how it is described).
_FORMAT_NEEDS = {"pack-quantized": ("name:weight_packed", "packed 4- or 8-bit tensors (*.weight_packed)"),
                 "int-quantized": ("dtype:I8", "int8 weight tensors"),
                 "float-quantized": ("dtype:F8_E4M3", "FP8 weight tensors")}
_MAX_HEADER = 100 << 20  # safetensors' own bound


class CheckpointError(ValueError):
    """The weights cannot be read, or do not match what config.json says of them."""


def read_header(path: Path) -> dict[str, str]:
    """The tensors of one safetensors file, name -> dtype."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name} is not a safetensors file (shorter than its header): a corrupted or "
                                  "truncated copy; copy the model again and check it with `appliance model verify`")
        (size,) = struct.unpack("<Q", head)
        raw = f.read(size) if size <= _MAX_HEADER else b""
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name} has no readable safetensors header: a corrupted or truncated copy; copy "
                              "the model again and check it with `appliance model verify`")
    return {name: str(t.get("dtype")) for name, t in header.items() if name != "__metadata__" and isinstance(t, dict)}


def _tensors(folder: Path) -> dict[str, str]:
    tensors: dict[str, str] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(read_header(path))
    return tensors


def _quantized(tensors: dict[str, str]) -> list[str]:
    return [n for n, dtype in tensors.items() if n.endswith(_QUANTIZED_SUFFIXES) or dtype in _QUANTIZED_DTYPES]


def _has(tensors: dict[str, str], need: str) -> bool:
    kind, value = need.split(":", 1)
    if kind == "name":
        return any(n.endswith(value) for n in tensors)
    return value in tensors.values()


def label_problem(folder: Path, config: dict[str, Any]) -> str | None:
    """Why the folder's weights are not what its config says, or None (also when there are no safetensors
    files to read: a .bin checkpoint is left to the engine)."""
    tensors = _tensors(folder)
    if not tensors:
        return None
    quantized = _quantized(tensors)
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        if quantized:
            return (f"its weights are quantized ({len(quantized)} tensors such as {quantized[0]}) but config.json has "
                    "no quantization_config: a mislabeled build; restore the build's own config.json or build it "
                    "again with `appliance model quantize`")
        return None
    method = qc.get("quant_method", "")
    if method in ("gptq", "awq") and not quantized:
        return (f"config.json says the weights are {method}-quantized, but no tensor is (no qweight or scales): a "
                "mislabeled build, or an unquantized model given a quantized model's config.json")
    if method == "compressed-tensors" and qc.get("config_groups"):
        fmt = qc.get("format", "")
        need = _FORMAT_NEEDS.get(fmt)
        if need and not _has(tensors, need[0]):
            return (f"config.json says the weights are compressed-tensors '{fmt}', which holds {need[1]}, and none of "
                    "its tensors are: a mislabeled build (another build's config.json?); restore its own config.json "
                    "or build it again with `appliance model quantize`")
    return None
