"""The HTTP libraries whose internals the gateway reaches into, held to the versions the suite ran.

appliance/api/http_protocol.py subclasses uvicorn's httptools protocol and reads and writes its
RequestResponseCycle's private fields (response_started, chunked_encoding, flow.write_paused, transport,
disconnected, message_event); appliance/api/engine_stream.py drives httptools' parser. Neither library
promises those internals, so a distribution update could break every local stream. pyproject.toml pins
both with an upper bound; the RPM's requirements are generated from the same metadata, and the OCI image
installs from it. At start the daemon reads the pins back from its own installed metadata (one source,
never a copy) and refuses a version outside them, naming the tested range.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

DISTRIBUTION = "edge-appliance"
REACHED_INTO = ("uvicorn", "httptools")


def pinned_ranges() -> dict[str, SpecifierSet]:
    """Each reached-into library's range, as the installed appliance's metadata states it."""
    out: dict[str, SpecifierSet] = {}
    for line in metadata.requires(DISTRIBUTION) or []:
        req = Requirement(line)
        if req.name in REACHED_INTO and req.marker is None:
            out[req.name] = req.specifier
    return out


def library_problems() -> list[str]:
    """A reached-into library missing, unpinned, or at a version outside its tested range."""
    try:
        ranges = pinned_ranges()
    except metadata.PackageNotFoundError:
        return [f"the {DISTRIBUTION} distribution's metadata is missing: reinstall the appliance (its "
                "requirements say which uvicorn and httptools it was tested with)"]
    problems = []
    for name in REACHED_INTO:
        spec = ranges.get(name)
        if spec is None or not any(s.operator in ("<", "<=", "==", "~=") for s in spec):
            problems.append(f"{DISTRIBUTION}'s metadata gives {name} no upper bound: reinstall the appliance")
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed; the appliance needs {name}{spec}")
            continue
        if not spec.contains(installed, prereleases=True):
            problems.append(f"{name} {installed} is installed, but the appliance reaches into its internals and was "
                            f"tested with {name}{spec} only: install a version in that range (the fleet's "
                            "repository pins it) or an appliance release tested with this one")
    return problems
