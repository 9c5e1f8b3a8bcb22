"""kvbudget.checkpoint: weights whose config.json says something else, and unreadable headers, refused at
start (issue 32: "a corrupted or mislabeled quantized folder refused at start with a clear error")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from appliance.boot import config
from appliance.boot.startup import model_problems
from kvbudget.checkpoint import CheckpointError, label_problem, read_header

DENSE = {"model.layers.0.mlp.down_proj.weight": np.zeros((4, 4), dtype=np.float16)}
INT8 = {"model.layers.0.mlp.down_proj.weight": np.zeros((4, 4), dtype=np.int8),
        "model.layers.0.mlp.down_proj.weight_scale": np.ones((4, 1), dtype=np.float16)}
PACKED = {"model.layers.0.mlp.down_proj.weight_packed": np.zeros((4, 1), dtype=np.int32),
          "model.layers.0.mlp.down_proj.weight_scale": np.ones((4, 1), dtype=np.float16)}


def _ct(fmt: str) -> dict:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                    "config_groups": {"group_0": {"targets": ["Linear"]}}}}


def _folder(tmp_path: Path, tensors: dict, cfg: dict) -> Path:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("tensors,cfg", [(DENSE, {}), (INT8, _ct("int-quantized")), (PACKED, _ct("pack-quantized"))])
def test_weights_that_are_what_the_config_says_pass(tmp_path: Path, tensors: dict, cfg: dict):
    assert label_problem(_folder(tmp_path, tensors, cfg), cfg) is None


def test_quantized_weights_without_a_quantization_config_are_a_mislabeled_build(tmp_path: Path):
    problem = label_problem(_folder(tmp_path, PACKED, {}), {})
    assert problem and "no quantization_config" in problem and "weight_packed" in problem


@pytest.mark.parametrize("tensors,cfg,says", [
    (INT8, _ct("pack-quantized"), "'pack-quantized'"),  # another scheme's config.json
    (PACKED, _ct("int-quantized"), "'int-quantized'"),
    (DENSE, _ct("float-quantized"), "'float-quantized'"),  # an unquantized model given a quantized config
    (DENSE, {"quantization_config": {"quant_method": "gptq"}}, "gptq-quantized"),
])
def test_a_config_that_claims_another_format_is_refused(tmp_path: Path, tensors: dict, cfg: dict, says: str):
    problem = label_problem(_folder(tmp_path, tensors, cfg), cfg)
    assert problem and says in problem and "mislabeled" in problem


@pytest.mark.parametrize("data", [b"", b"\x10\0\0\0\0\0\0\0not json at all!", b"\x02\0\0\0\0\0\0\0[]"])
def test_a_header_that_does_not_parse_is_a_corrupted_copy(tmp_path: Path, data: bytes):
    (tmp_path / "model.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        read_header(tmp_path / "model.safetensors")


def test_start_up_refuses_a_mislabeled_model_naming_its_folder(tmp_path: Path):
    (tmp_path / "m").mkdir()
    model = _folder(tmp_path / "m", INT8, {})
    cfg = config.Config.model_validate({"model": {"path": str(model)}})
    problems = model_problems(cfg)
    assert len(problems) == 1 and str(model) in problems[0] and "mislabeled" in problems[0]
    (model / "config.json").write_text(json.dumps(_ct("int-quantized")))
    assert model_problems(cfg) == []
    (model / "model.safetensors").write_bytes(b"\xff" * 12)
    assert "corrupted" in model_problems(cfg)[0]
