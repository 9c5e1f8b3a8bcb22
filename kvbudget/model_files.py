"""A model folder on disk: config.json, and exact weight bytes from the safetensors headers alone
(only the JSON header of each file is read, never the tensors)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvbudget.model import ModelError, ModelShape, positive_int, shape_from_config, text_config


def safetensors_bytes(folder: Path) -> int:
    """Exact tensor bytes of every *.safetensors file in folder, from their headers alone."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors files")
    total = 0
    for f in files:
        with f.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ModelError(f"{f.name} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise ModelError(f"{f.name} has an implausible header length {n}")
            try:
                header = json.loads(fh.read(n))
            except ValueError as e:
                raise ModelError(f"{f.name} has a malformed safetensors header: {e}") from None
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            total += end - start
    return total


def read_model_folder(folder: Path) -> ModelShape:
    """Shape from config.json plus exact weight bytes from the safetensors headers."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{folder} has no config.json: not a Hugging Face model folder")
    shape = replace(shape_from_config(_read_json(cfg_path), name=folder.name), chat_template=read_chat_template(folder))
    if any(folder.glob("*.safetensors")):
        return replace(shape, weight_bytes=safetensors_bytes(folder), weight_bytes_exact=True, notes=())
    return shape


def read_chat_template(folder: Path) -> str | None:
    """The chat template vLLM would use: chat_template.jinja, else tokenizer_config.json's (a string, or
    the "default" of a list of named templates)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(errors="replace")
    tok = folder / "tokenizer_config.json"
    if not tok.is_file():
        return None
    try:
        given = _read_json(tok).get("chat_template")
    except (ModelError, AttributeError):
        return None
    if isinstance(given, list):
        named = {t.get("name"): t.get("template") for t in given if isinstance(t, dict)}
        given = named.get("default") or next(iter(named.values()), None)
    return given if isinstance(given, str) else None


def read_model(path: Path) -> ModelShape:
    """A model folder, or a bare config.json (weights then estimated)."""
    path = Path(path)
    if path.is_dir():
        return read_model_folder(path)
    if not path.is_file():
        raise ModelError(f"{path} does not exist")
    return shape_from_config(_read_json(path), name=path.stem if path.name != "config.json" else path.parent.name)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class DraftModel:
    """An EAGLE draft as vLLM will load it: its folder, exact weight bytes and the KV layers it adds."""

    path: Path
    weight_bytes: int
    kv_layers: int


def read_draft(folder: Path) -> DraftModel:
    """A local EAGLE-3 draft folder: bytes from its safetensors headers, KV layers from its config.json.

    vLLM's EAGLE-3 heads (llama_eagle3.py) build `num_hidden_layers` decoder layers, each with an attention
    layer that joins the target's KV pool.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"draft model {folder} is not a folder: give the EAGLE-3 draft's local folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"draft model {folder} has no config.json")
    cfg = _read_json(cfg_path)
    layers = positive_int(text_config(cfg) if isinstance(cfg, dict) else {}, "num_hidden_layers")
    return DraftModel(folder.resolve(), safetensors_bytes(folder), layers)
