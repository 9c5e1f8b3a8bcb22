"""Model artifact pinning: is the model folder byte for byte the artifact the fleet pinned?

The pin is the digest of the folder's manifest (kernels/manifest.py). It is read from `model.digest` in
the configuration (GitOps pins it there) or, failing that, from the manifest `appliance model pin`
wrote into the folder. File-level differences need that manifest; a digest alone says only "different".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernels.manifest import MANIFEST_NAME, Difference, Manifest, Progress, build, compare, total_size


@dataclass(frozen=True)
class ModelCheck:
    digest: str
    pinned: str | None
    source: str  # "model.digest", "manifest file" or "unpinned"
    differences: tuple[Difference, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.pinned is None or (self.digest == self.pinned and not self.differences)

    def describe(self) -> str:
        if self.pinned is None:
            return f"model is not pinned (digest {self.digest}); run `appliance model pin` to pin it"
        if self.ok:
            return f"model matches its pin {self.pinned} ({self.source})"
        files = "; ".join(f"{d.path}: {d.problem}" for d in self.differences[:20]) or "no per-file manifest to compare"
        return f"model does not match its pin {self.pinned} ({self.source}): digest {self.digest}; {files}"


def read_manifest(folder: Path) -> Manifest | None:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    return Manifest.from_json(path.read_text())


def check(folder: Path, pinned_digest: str | None, progress: Progress | None = None) -> ModelCheck:
    actual = build(folder, progress)
    manifest = read_manifest(folder)
    if pinned_digest:
        diffs = compare(manifest, actual) if manifest and manifest.digest == pinned_digest else []
        return ModelCheck(actual.digest, pinned_digest, "model.digest", tuple(diffs))
    if manifest is not None:
        return ModelCheck(actual.digest, manifest.digest, "manifest file", tuple(compare(manifest, actual)))
    return ModelCheck(actual.digest, None, "unpinned")


def pin(folder: Path, progress: Progress | None = None) -> Manifest:
    manifest = build(folder, progress)
    (Path(folder) / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def progress_bar(folder: Path, what: str):
    """A tqdm bar on a terminal (hashing a 50 GB model takes a while); silent otherwise."""
    from tqdm import tqdm

    return tqdm(total=total_size(folder), unit="B", unit_scale=True, desc=what, file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)
