"""quantize/: the scheme's settings chosen from the model, calibration data read and checked, and a build
placed atomically. LLM Compressor itself runs in tests/integration/test_quantized.py; here a stand-in for
the worker's interpreter writes (or fails to write) the folder, so the placement is what is tested."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest

from appliance.store.requests import RequestLog, RequestRecord
from kernels.manifest import MANIFEST_NAME
from quantize import build, calibration
from tests.support import REPO

FIXTURES = REPO / "tests" / "fixtures" / "models"

# A worker stand-in: writes a quantized-looking folder (an int8 tensor and its config) where the spec says.
FAKE_WORKER = """#!{python}
import json, sys
spec = json.load(open(sys.argv[-1]))
if spec["source"].endswith("fails"):
    print("something went wrong", file=sys.stderr); sys.exit(3)
import numpy as np, os
from safetensors.numpy import save_file
os.makedirs(spec["out"])
save_file({{"w": np.zeros((2, 2), dtype=np.int8), "w_scale": np.ones((2, 1), dtype=np.float16)}}, spec["out"] + "/model.safetensors")
cfg = json.load(open(spec["source"] + "/config.json"))
if not spec["source"].endswith("unlabelled"):
    cfg["quantization_config"] = {{"quant_method": "compressed-tensors", "format": "int-quantized",
                                   "config_groups": {{"group_0": {{"targets": ["Linear"]}}}}}}
json.dump(cfg, open(spec["out"] + "/config.json", "w"))
print(json.dumps({{"tools": {{"llmcompressor": "test"}}}}))
"""


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name,group", [("smollm2-135m-instruct", 64), ("qwen3.6-27b", 128), ("llama-3.1-8b", 128),
                                        ("qwen3.5-35b-a3b", 128)])
def test_the_4_bit_group_is_the_largest_that_divides_every_layer(name: str, group: int):
    assert build.group_size(_fixture(name)) == group


def test_a_model_no_group_fits_is_told_to_use_int8():
    with pytest.raises(build.BuildError, match="w8a8-int8"):
        build.group_size({"hidden_size": 100, "num_attention_heads": 4, "intermediate_size": 300})


def test_the_shipped_calibration_set_is_valid_and_varied():
    shipped = calibration.shipped()
    assert calibration.from_file(calibration.SHIPPED).items == shipped.items
    assert len(shipped.items) >= 48
    assert sum(len(i["messages"]) > 1 for i in shipped.items) >= 4  # multi-turn and system prompts too


@pytest.mark.parametrize("line,says", [("not json", "not JSON"), ('{"messages": []}', "each line must be"),
                                       ('{"messages": [{"role": "user"}]}', "each line must be")])
def test_a_calibration_file_with_a_bad_line_names_it(tmp_path: Path, line: str, says: str):
    path = tmp_path / "cal.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(calibration.CalibrationError, match=f"cal.jsonl:2: {says}"):
        calibration.from_file(path)


def _log(tmp_path: Path, keep_text: bool) -> Path:
    db = tmp_path / "appliance.db"
    log = RequestLog(db, keep_text=keep_text)
    log.start()
    chat = json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Opening hours?"}])
    for i, (route, prompt, status) in enumerate([("/v1/chat/completions", chat, 200), ("/v1/completions", "Once", 200),
                                                  ("/v1/chat/completions", chat, 400), ("/v1/embeddings", "x", 200)]):
        log.record(RequestRecord(id=f"r{i}", ts=time.time() + i, route=route, model="m", status=status, stream=False,
                                 prompt=prompt))
    log.close()
    return db


def test_the_site_s_kept_prompts_calibrate_when_asked(tmp_path: Path):
    got = calibration.from_request_log(_log(tmp_path, keep_text=True), limit=10)
    assert sorted(map(json.dumps, got.items)) == sorted([
        json.dumps({"text": "Once"}),
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Opening hours?"}]})])


def test_a_log_that_kept_no_prompts_says_so(tmp_path: Path):
    with pytest.raises(calibration.CalibrationError, match=r"state\.log_prompts"):
        calibration.from_request_log(_log(tmp_path, keep_text=False), limit=10)


def _source(tmp_path: Path, name: str = "src") -> Path:
    src = tmp_path / name
    src.mkdir()
    (src / "config.json").write_text((FIXTURES / "smollm2-135m-instruct.json").read_text())
    return src


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    import sys

    path = tmp_path / "fake-python"
    path.write_text(FAKE_WORKER.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_build_is_described_pinned_and_moved_into_place(tmp_path: Path, fake_python: Path):
    out = tmp_path / "builds" / "smol-int8"
    made = build.quantize(_source(tmp_path), out, build.SCHEMES["w8a8-int8"], python=fake_python,
                          calibration=calibration.shipped(), samples=8, log=tmp_path / "q.log")
    described = json.loads((out / build.BUILD_FILE).read_text())
    assert described["scheme"] == "w8a8-int8" and described["calibration"]["items"] == len(calibration.shipped().items)
    assert described["weight_format"].startswith("compressed-tensors") and described["tools"] == {"llmcompressor": "test"}
    assert json.loads((out / MANIFEST_NAME).read_text())["files"] and made.digest.startswith("sha256:")
    assert [p.name for p in out.parent.iterdir()] == ["smol-int8"]  # no partial folder left beside it


@pytest.mark.parametrize("source,says", [("fails", "LLM Compressor failed"), ("unlabelled", "no quantization config")])
def test_a_failed_build_leaves_nothing_and_the_old_build_stands(tmp_path: Path, fake_python: Path, source: str,
                                                                 says: str):
    out = tmp_path / "builds" / "smol"
    out.mkdir(parents=True)
    (out / "old").write_text("the build in service")
    with pytest.raises(build.BuildError, match=says):
        build.quantize(_source(tmp_path, source), out, build.SCHEMES["w8a8-int8"], python=fake_python,
                       calibration=calibration.shipped(), log=tmp_path / "q.log", force=True)
    assert [p.name for p in out.parent.iterdir()] == ["smol"] and (out / "old").read_text() == "the build in service"


def test_force_replaces_a_build_and_without_it_an_existing_folder_is_refused(tmp_path: Path, fake_python: Path):
    out = tmp_path / "smol"
    out.mkdir()
    (out / "old").write_text("x")
    kwargs = {"python": fake_python, "calibration": calibration.shipped(), "log": tmp_path / "q.log"}
    with pytest.raises(build.BuildError, match="--force"):
        build.quantize(_source(tmp_path), out, build.SCHEMES["w8a8-int8"], **kwargs)
    build.quantize(_source(tmp_path, "src2"), out, build.SCHEMES["w8a8-int8"], force=True, **kwargs)
    assert not (out / "old").exists() and (out / build.BUILD_FILE).is_file()


def test_an_already_quantized_source_and_a_calibrated_scheme_without_data_are_refused(tmp_path: Path):
    src = _source(tmp_path)
    with pytest.raises(build.BuildError, match="needs calibration"):
        build.quantize(src, tmp_path / "o", build.SCHEMES["w4a16"], python=Path("/bin/false"), calibration=None,
                       log=tmp_path / "q.log")
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(build.BuildError, match="already quantized \\(awq\\)"):
        build.quantize(src, tmp_path / "o", build.SCHEMES["fp8-dynamic"], python=Path("/bin/false"), calibration=None,
                       log=tmp_path / "q.log")


def test_the_command_names_a_bad_calibration_file_before_setting_anything_up(tmp_path: Path):
    from click.testing import CliRunner

    from appliance.cli import main

    (tmp_path / "bad.jsonl").write_text("{not json\n")
    env = {"APPLIANCE_QUANTIZE_ENV": str(tmp_path / "never-made")}
    r = CliRunner().invoke(main, ["model", "quantize", str(_source(tmp_path)), "--scheme", "w4a16", "--out",
                                 str(tmp_path / "o"), "--calibration", str(tmp_path / "bad.jsonl")], env=env)
    assert r.exit_code == 2 and "bad.jsonl:1: not JSON" in r.output
    assert not (tmp_path / "never-made").exists() and not (tmp_path / "o").exists()
