"""Manifests of file trees: every file's size and sha256, and one digest over the whole list.

Used to pin model artifacts (the same digest at every site means the same model) and, later, the
native libraries the engine loads. The digest is sha256 over the canonical JSON of the sorted file list,
so it does not depend on the order files were written or on file timestamps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FORMAT = "appliance-manifest/1"
MANIFEST_NAME = "appliance-manifest.json"
CHUNK = 8 << 20

Progress = Callable[[int], None]  # called with the bytes just hashed


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, with forward slashes
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileEntry, ...]

    @property
    def digest(self) -> str:
        canonical = json.dumps([[f.path, f.size, f.sha256] for f in self.files], separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "digest": self.digest,
                           "files": [f.__dict__ for f in self.files]}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} manifest (format {data.get('format')!r})")
        m = cls(tuple(FileEntry(f["path"], int(f["size"]), f["sha256"]) for f in data["files"]))
        if data.get("digest") != m.digest:
            raise ValueError("the manifest's recorded digest does not match its file list (edited by hand?)")
        return m


@dataclass(frozen=True)
class Difference:
    path: str
    problem: str  # "modified", "missing", "unexpected", "size changed"


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def hash_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def build(root: Path, progress: Progress | None = None) -> Manifest:
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")
    entries = [FileEntry(p.relative_to(root).as_posix(), p.stat().st_size, hash_file(p, progress))
               for p in files_of(root)]
    return Manifest(tuple(entries))


def total_size(root: Path) -> int:
    return sum(p.stat().st_size for p in files_of(Path(root)))


def compare(expected: Manifest, actual: Manifest) -> list[Difference]:
    want = {f.path: f for f in expected.files}
    have = {f.path: f for f in actual.files}
    out = []
    for path in sorted(want.keys() | have.keys()):
        w, h = want.get(path), have.get(path)
        if h is None:
            out.append(Difference(path, "missing"))
        elif w is None:
            out.append(Difference(path, "unexpected"))
        elif w.size != h.size:
            out.append(Difference(path, "size changed"))
        elif w.sha256 != h.sha256:
            out.append(Difference(path, "modified"))
    return out
