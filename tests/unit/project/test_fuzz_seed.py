"""A fuzz seed draws the same probes whatever the process drawing them has imported (tests.fuzz.isolated):
"rerun with FUZZ_SEED=..." must repeat the run CI made with the whole suite loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO

# Prints a digest of the probes a seed draws, after importing what the process is given to import.
DRAW = """
import hashlib, importlib, pkgutil, sys
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    for m in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
from tests.fuzz.campaign import Limits, draw_probes
from tests.fuzz.wire import draw_wire_probes
limits = Limits()
probes = draw_probes(150, 20261125, "m", limits.max_tokens, limits.max_choices, limits.max_body_bytes)
wire = draw_wire_probes(60, 20261125)
print(hashlib.sha256(repr((probes, wire)).encode()).hexdigest())
"""

# A module of the site's own code as Hypothesis sees it (not in site-packages, not under tests/), whose
# literals join its pool of constants wherever it is imported.
CANARY = """
NAMES = ("x-fuzz-canary-header", "canary model name", "/v1/canary/route")
NUMBERS = (7_777_777, -31_337, 0.125)
"""


def _digest(tmp: Path, *imports: str) -> str:
    r = subprocess.run([sys.executable, "-c", DRAW, *imports], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": f"{REPO}:{tmp}", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_a_seed_draws_the_same_probes_whatever_the_process_imported(tmp_path: Path):
    (tmp_path / "site_canary.py").write_text(CANARY)
    bare = _digest(tmp_path)
    loaded = _digest(tmp_path, "appliance", "kvbudget", "cascade", "kernels", "site_canary")
    assert bare == loaded, "the probes a seed draws depend on the modules the drawing process has imported"
