"""A CycloneDX SBOM of the appliance's environment (cyclonedx-python-lib), with the kernel lock's hashes.

Every installed distribution is a library component with its package URL; the engine's packages also
carry each native file of the lock as a file sub-component with its SHA-256, and the lock's digest is a
property of the BOM, so the SBOM shipped in an image proves which kernels that image loads.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from cyclonedx.model import HashAlgorithm, HashType, Property
from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.output.json import JsonV1Dot6
from packageurl import PackageURL

PROPERTY_LOCK_DIGEST = "appliance:kernel-lock-digest"


def _component(name: str, version: str) -> Component:
    return Component(name=name, version=version, type=ComponentType.LIBRARY,
                     purl=PackageURL(type="pypi", name=name.lower(), version=version),
                     bom_ref=f"pkg:pypi/{name.lower()}@{version}")


def build(lock: dict[str, Any] | None, version: str, dists: list[tuple[str, str]] | None = None) -> Bom:
    """The BOM of `dists` ((name, version) pairs; default: this environment) plus the lock's files."""
    bom = Bom()
    bom.metadata.component = Component(name="edge-appliance", version=version, type=ComponentType.APPLICATION,
                                       bom_ref="edge-appliance")
    if dists is None:
        seen: dict[str, tuple[str, str]] = {}
        for d in metadata.distributions():
            name = d.metadata["Name"]
            if name and name.lower() not in seen:
                seen[name.lower()] = (name, d.version)
        dists = sorted(seen.values(), key=lambda x: x[0].lower())
    locked = {p["name"].lower(): p for p in (lock or {}).get("packages", [])}
    for name, version in dists:
        comp = _component(name, version)
        pkg = locked.pop(name.lower(), None)
        if pkg is not None:
            _add_files(comp, pkg)
        bom.components.add(comp)
    for pkg in locked.values():  # locked for the engine's interpreter but not installed here
        comp = _component(pkg["name"], pkg["version"])
        _add_files(comp, pkg)
        bom.components.add(comp)
    # the appliance depends on every component: the graph is complete (and validators stop warning)
    bom.register_dependency(bom.metadata.component, list(bom.components))
    if lock is not None:
        bom.metadata.properties.add(Property(name=PROPERTY_LOCK_DIGEST, value=lock["digest"]))
    return bom


def _add_files(comp: Component, pkg: dict[str, Any]) -> None:
    for f in pkg["files"]:
        if not f["sha256"]:
            continue
        fc = Component(name=f["path"], type=ComponentType.FILE,
                       bom_ref=f"{comp.bom_ref.value}#{f['path']}",
                       hashes=[HashType(alg=HashAlgorithm.SHA_256, content=f["sha256"])])
        comp.components.add(fc)


def to_json(bom: Bom) -> str:
    return JsonV1Dot6(bom).output_as_string(indent=2)
