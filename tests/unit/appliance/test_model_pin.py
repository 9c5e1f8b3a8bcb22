"""Model artifact pinning: manifests, the CLI, and the refusal at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.manifest import MANIFEST_NAME, Manifest, build, compare
from tests.support import EMPTY_SAFETENSORS


def _model(tmp_path: Path) -> Path:
    m = tmp_path / "model"
    (m / "sub").mkdir(parents=True)
    (m / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    # a readable header (start-up reads it) and then bytes standing in for the tensors
    (m / "model.safetensors").write_bytes(EMPTY_SAFETENSORS + bytes(range(256)) * 64)
    (m / "sub" / "tokenizer.json").write_text("{}")
    return m


def appliance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance.cli", *args], capture_output=True, text=True, timeout=120)


def test_digest_is_stable_and_sensitive(tmp_path):
    m = _model(tmp_path)
    a = build(m)
    assert [f.path for f in a.files] == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert a.digest == build(m).digest and a.digest.startswith("sha256:")
    data = bytearray((m / "model.safetensors").read_bytes())
    data[1000] ^= 1
    (m / "model.safetensors").write_bytes(bytes(data))
    b = build(m)
    assert b.digest != a.digest
    assert [(d.path, d.problem) for d in compare(a, b)] == [("model.safetensors", "modified")]


def test_compare_names_missing_unexpected_and_resized(tmp_path):
    m = _model(tmp_path)
    a = build(m)
    (m / "sub" / "tokenizer.json").unlink()
    (m / "extra.bin").write_bytes(b"x")
    (m / "config.json").write_text("{}")
    got = {(d.path, d.problem) for d in compare(a, build(m))}
    assert got == {("sub/tokenizer.json", "missing"), ("extra.bin", "unexpected"), ("config.json", "size changed")}


def test_a_hand_edited_manifest_is_rejected(tmp_path):
    m = _model(tmp_path)
    data = json.loads(build(m).to_json())
    data["files"][0]["sha256"] = "0" * 64
    with pytest.raises(ValueError, match="does not match its file list"):
        Manifest.from_json(json.dumps(data))


def test_pin_and_verify_commands(tmp_path):
    m = _model(tmp_path)
    r = appliance("model", "verify", "--model", str(m))
    assert r.returncode == 2 and "not pinned" in r.stderr
    r = appliance("model", "pin", "--model", str(m))
    digest = r.stdout.strip()
    assert r.returncode == 0 and digest == build(m).digest and (m / MANIFEST_NAME).is_file()
    assert appliance("model", "verify", "--model", str(m)).returncode == 0
    data = bytearray((m / "model.safetensors").read_bytes())
    data[100] ^= 0xFF
    (m / "model.safetensors").write_bytes(bytes(data))
    r = appliance("model", "verify", "--model", str(m))
    assert r.returncode == 1 and "modified" in r.stdout and "model.safetensors" in r.stdout
    r = appliance("model", "verify", "--model", str(m), "--digest", digest)
    assert r.returncode == 1


def test_serve_refuses_a_tampered_model_before_starting_the_engine(tmp_path):
    m = _model(tmp_path)
    digest = appliance("model", "pin", "--model", str(m)).stdout.strip()
    (m / "sub" / "tokenizer.json").write_text('{"tampered": true}')
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'[model]\npath = "{m}"\ndigest = "{digest}"\nverify = "fail"\n'
                   f'[state]\ndirectory = "{tmp_path}/state"\n')
    r = appliance("serve", "--config", str(cfg))
    assert r.returncode == 2
    assert "does not match its pin" in r.stderr and "sub/tokenizer.json" in r.stderr and "refusing to start" in r.stderr
    assert "starting engine" not in r.stderr


def test_digest_must_look_like_one(tmp_path):
    cfg = tmp_path / "a.toml"
    cfg.write_text('[model]\npath = "/m"\ndigest = "md5:abc"\n')
    r = appliance("config", "check", "--config", str(cfg))
    assert r.returncode == 2 and "model.digest" in r.stderr



def test_an_unreadable_model_file_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch):
    # Root reads any file here, so the read failure is injected where hashing opens the file.
    import json

    from click.testing import CliRunner

    from appliance.cli import main
    from kernels import manifest
    from tests.support import model_folder

    model = model_folder(tmp_path)
    cfg = tmp_path / "appliance.toml"
    cfg.write_text(f'[model]\npath = "{model}"\nverify = "fail"\n[state]\ndirectory = "{tmp_path / "s"}"\n'
                   '[server]\nport = 1\n')

    def denied(path, progress=None):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(manifest, "hash_file", denied)
    r = CliRunner().invoke(main, ["model", "verify", "--config", str(cfg)])
    assert r.exit_code == 2  # a clear error, not a traceback (CliRunner would show exit 1 and the exception)
    assert "cannot read" in r.output and "Permission denied" in r.output
    r = CliRunner().invoke(main, ["doctor", "--config", str(cfg), "--json", "--no-live"])
    model_finding = next(f for f in json.loads(r.output)["findings"] if f["check"] == "model")
    assert r.exit_code == 1 and model_finding["status"] == "fail" and "cannot read" in model_finding["summary"]
