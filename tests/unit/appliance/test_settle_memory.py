"""The daemon settles its memory before serving (appliance.runtime.daemon.settle_memory): start-up's objects
frozen out of the collector's passes and a larger young generation, in a process of its own (the setting
is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

from appliance.runtime.daemon import GC_YOUNG_THRESHOLD


def test_start_ups_objects_are_frozen_and_the_young_generation_is_larger():
    code = ("import gc, json\nimport appliance.boot.assembly\nfrom appliance.runtime.daemon import settle_memory\n"
            "before = gc.get_freeze_count()\nsettle_memory()\n"
            "print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold(), gc.isenabled()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, frozen, threshold, enabled = json.loads(out.stdout)
    assert before == 0 and frozen > 10_000, frozen  # the imported modules' objects, at least
    assert threshold[0] == GC_YOUNG_THRESHOLD and enabled  # collected less often, never switched off
