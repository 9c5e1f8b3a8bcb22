"""Other builds of the default model, made in seconds, for upgrade tests: a good one at another dtype and
broken ones (each way an upgrade must catch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from appliance.boot import model_pin

WEIGHTS = "model.safetensors"


def _copy_without_weights(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != WEIGHTS and f.name != model_pin.MANIFEST_NAME:
            shutil.copy2(f, dest / f.name)


def _rewrite(src: Path, dest: Path, change) -> Path:
    """dest: src's files with its tensors passed through change(name, tensor) -> tensor."""
    from safetensors.torch import load_file, save_file

    _copy_without_weights(src, dest)
    tensors = load_file(str(src / WEIGHTS))
    save_file({k: change(k, v).contiguous() for k, v in tensors.items()}, str(dest / WEIGHTS),
              metadata={"format": "pt"})
    return dest


def converted(src: Path, dest: Path, dtype: str = "float16") -> Path:
    """The same model at another dtype: a good new build (other bytes, other digest, same answers nearly)."""
    import torch

    to = getattr(torch, dtype)
    _rewrite(src, dest, lambda _name, t: t.to(to))
    cfg = json.loads((dest / "config.json").read_text())
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def garbled(src: Path, dest: Path) -> Path:
    """Loads and answers, but nonsense: the final norm's weights negated, so every logit is reversed."""
    return _rewrite(src, dest, lambda name, t: -t if name == "model.norm.weight" else t)


def truncated(src: Path, dest: Path) -> Path:
    """A weight file cut short after its header: its pin holds (it is what was pinned), the engine cannot load it."""
    _copy_without_weights(src, dest)
    data = (src / WEIGHTS).read_bytes()
    (dest / WEIGHTS).write_bytes(data[: len(data) // 3])
    return dest


def digest(folder: Path) -> str:
    return model_pin.check(folder, None).digest
