"""The kernel lock: which native engine code, byte for byte, every replica of the fleet loads.

`write` records a scan of the engine's environment (kernels/scan.py) as a lock file; `verify` scans
again and names every file that was modified, is missing or is unexpected, and every package whose
version moved. The lock's digest (sha256 over its canonical package and file list) is what a fleet
operator compares across sites.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels import scan as scan_mod

FORMAT = "appliance-kernel-lock/1"


class LockError(Exception):
    pass


@dataclass(frozen=True)
class Mismatch:
    package: str
    path: str  # "" for a package-level problem
    problem: str  # modified, missing, unexpected, version changed, package missing, package unexpected

    def __str__(self) -> str:
        where = f"{self.package}: {self.path}" if self.path else self.package
        return f"{self.problem:18} {where}"


def scan_environment(python: str | None = None, paths: list[str] | None = None) -> dict[str, Any]:
    """Scan in this interpreter, or run scan.py under the engine's interpreter and read its JSON."""
    if not python or Path(python).resolve() == Path(sys.executable).resolve():
        return scan_mod.scan(paths)
    try:
        out = subprocess.run([python, scan_mod.__file__, *(paths or [])], capture_output=True, text=True,
                             timeout=1800, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise LockError(f"cannot scan the engine's environment with {python}: {e}") from None
    return json.loads(out.stdout)


def digest(lock: dict[str, Any]) -> str:
    canon = [[p["name"].lower(), p["version"], [[f["path"], f["size"], f["sha256"]] for f in p["files"]]]
             for p in lock["packages"]]
    return "sha256:" + hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()


def make_lock(scanned: dict[str, Any]) -> dict[str, Any]:
    packages = [{"name": p["name"], "version": p["version"], "files": p["files"]} for p in scanned["packages"]]
    lock = {"format": FORMAT, "python": scanned["python"], "machine": scanned["machine"], "packages": packages}
    lock["digest"] = digest(lock)
    return lock


def write(path: Path, python: str | None = None, paths: list[str] | None = None) -> dict[str, Any]:
    lock = make_lock(scan_environment(python, paths))
    if not lock["packages"]:
        raise LockError("no engine packages found (vllm, torch, ...): is this the engine's environment?")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(lock, indent=1) + "\n")
    return lock


def read(path: Path) -> dict[str, Any]:
    try:
        lock = json.loads(path.read_text())
    except FileNotFoundError:
        raise LockError(f"kernel lock {path} does not exist; write it with `appliance kernels lock`") from None
    except (OSError, ValueError) as e:
        raise LockError(f"cannot read kernel lock {path}: {e}") from None
    if lock.get("format") != FORMAT:
        raise LockError(f"{path} is not an {FORMAT} file")
    if lock.get("digest") != digest(lock):
        raise LockError(f"{path}: the recorded digest does not match its contents (edited by hand?)")
    return lock


def compare(lock: dict[str, Any], scanned: dict[str, Any]) -> list[Mismatch]:
    out: list[Mismatch] = []
    have = {p["name"].lower(): p for p in scanned["packages"]}
    want = {p["name"].lower(): p for p in lock["packages"]}
    for name, wp in want.items():
        hp = have.get(name)
        if hp is None:
            out.append(Mismatch(wp["name"], "", "package missing"))
            continue
        if hp["version"] != wp["version"]:
            out.append(Mismatch(wp["name"], "", f"version changed ({wp['version']} -> {hp['version']})"))
        hf = {f["path"]: f for f in hp["files"]}
        wf = {f["path"]: f for f in wp["files"]}
        for path, f in wf.items():
            g = hf.get(path)
            if g is None or g["size"] < 0:
                out.append(Mismatch(wp["name"], path, "missing"))
            elif (g["size"], g["sha256"]) != (f["size"], f["sha256"]):
                out.append(Mismatch(wp["name"], path, "modified"))
        out += [Mismatch(wp["name"], p, "unexpected") for p in sorted(set(hf) - set(wf))]
    out += [Mismatch(hp["name"], "", "package unexpected") for n, hp in sorted(have.items()) if n not in want]
    return out


def verify(path: Path, python: str | None = None, paths: list[str] | None = None) -> tuple[dict, list[Mismatch]]:
    lock = read(path)
    return lock, compare(lock, scan_environment(python, paths))


@dataclass(frozen=True)
class KernelCheck:
    """The outcome of verifying at start: reported in status, metrics and the doctor."""

    lock_path: str
    digest: str | None
    mismatches: tuple[Mismatch, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.mismatches

    def describe(self) -> str:
        if self.error:
            return self.error
        if self.ok:
            return f"engine kernels match the lock {self.lock_path} ({self.digest})"
        shown = "; ".join(str(m).strip() for m in self.mismatches[:10])
        more = f" and {len(self.mismatches) - 10} more" if len(self.mismatches) > 10 else ""
        return f"engine kernels differ from the lock {self.lock_path}: {shown}{more}"


def check(path: Path, python: str | None = None, paths: list[str] | None = None) -> KernelCheck:
    try:
        lock, mismatches = verify(path, python, paths)
    except LockError as e:
        return KernelCheck(str(path), None, error=str(e))
    return KernelCheck(str(path), lock["digest"], tuple(mismatches))
