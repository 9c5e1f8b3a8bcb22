"""Probes drawn in a Python process of their own, so a seed draws the same probes wherever it is run.

Hypothesis mixes into what it generates the literals of every "local" module the process has loaded (its
local-constants pool: any module outside site-packages, the standard library and folders named tests).
Drawn in pytest's own process, the probes for one seed depended on which of the project's modules that
run had imported (the whole suite imports many more than `pytest tests/integration/test_fuzz.py` does)
and on their text, so "rerun with FUZZ_SEED=..." did not draw what CI had drawn. The process here imports
only tests.fuzz (left out of the pool), so the probes depend on the seed, the strategies and Hypothesis.

    python -m tests.fuzz.isolated MODULE:FUNCTION JSON_ARGS     (the pickled list on standard output)

Nothing here may import the project's packages, in the child or at import time in the parent.
"""

from __future__ import annotations

import importlib
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def drawn(generator: str, *args: Any) -> list[Any]:
    """`generator(*args)` (a "tests.fuzz.module:function" drawing with Hypothesis), run in a fresh process."""
    r = subprocess.run([sys.executable, "-m", "tests.fuzz.isolated", generator, json.dumps(args)], cwd=REPO,
                       capture_output=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"drawing {generator}{args} failed:\n{r.stderr.decode(errors='replace')[-3000:]}")
    return pickle.loads(r.stdout)


def main() -> None:
    module, _, function = sys.argv[1].partition(":")
    if not module.startswith("tests.fuzz."):
        raise SystemExit(f"{module}: only the strategies in tests.fuzz draw here")
    result = getattr(importlib.import_module(module), function)(*json.loads(sys.argv[2]))
    sys.stdout.buffer.write(pickle.dumps(result))


if __name__ == "__main__":
    main()
