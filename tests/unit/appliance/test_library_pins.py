"""uvicorn and httptools, whose internals the gateway reaches into, are pinned with an upper bound, and the
daemon refuses to start on a version outside the pins (appliance/boot/library_pins.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from appliance.boot import config, library_pins
from appliance.boot.startup import runtime_problems
from tests.support import EMPTY_SAFETENSORS, REPO


def _pyproject_ranges() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: str(r.specifier) for r in map(Requirement, deps) if r.name in library_pins.REACHED_INTO}


def test_the_start_up_check_reads_the_pins_pyproject_states():
    """The check reads the installed metadata; it must say what pyproject.toml says (a stale install, or a
    pin changed without reinstalling, fails here), and each pin must close above."""
    ranges = {name: str(spec) for name, spec in library_pins.pinned_ranges().items()}
    assert ranges == _pyproject_ranges() and set(ranges) == set(library_pins.REACHED_INTO)
    for name, spec in ranges.items():
        assert "<" in spec or "==" in spec, f"{name} has no upper bound: {spec}"


def test_the_versions_the_suite_runs_are_inside_the_pins():
    assert library_pins.library_problems() == []
    for name, spec in library_pins.pinned_ranges().items():
        assert spec.contains(metadata.version(name))


def test_a_version_outside_the_pins_refuses_the_start(monkeypatch, tmp_path: Path):
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.99.1" if name == "uvicorn" else real(name))
    (problem,) = library_pins.library_problems()
    spec = library_pins.pinned_ranges()["uvicorn"]
    assert problem.startswith("uvicorn 0.99.1 is installed") and f"tested with uvicorn{spec} only" in problem
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    cfg = config.parse(f'[model]\npath = "{model}"\n[state]\ndirectory = "{tmp_path}/state"\n')
    assert runtime_problems(cfg) == [problem]


def test_a_missing_upper_bound_is_a_problem(monkeypatch):
    monkeypatch.setattr(metadata, "requires", lambda dist: ["uvicorn[standard]>=0.54", "httptools<0.10,>=0.9"])
    assert library_pins.library_problems() == ["edge-appliance's metadata gives uvicorn no upper bound: reinstall "
                                               "the appliance"]


def test_serve_refuses_with_the_tested_range(tmp_path: Path):
    """`appliance serve` on a box whose uvicorn is outside the pins: one line naming the range, exit 2."""
    shim = tmp_path / "shim"
    shim.mkdir()
    # a sitecustomize that makes this interpreter report another uvicorn version (as a distribution update would)
    (shim / "sitecustomize.py").write_text(
        "from importlib import metadata\n_real = metadata.version\n"
        "metadata.version = lambda n: '0.60.0' if n == 'uvicorn' else _real(n)\n")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    cfg = tmp_path / "appliance.toml"
    cfg.write_text(f'[model]\npath = "{model}"\n[state]\ndirectory = "{tmp_path}/state"\n')
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60, env={"PYTHONPATH": str(shim), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "uvicorn 0.60.0 is installed" in r.stderr and "tested with uvicorn" in r.stderr
