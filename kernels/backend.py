"""Which attention backend the engine chose, read from its startup log.

A decode regression after an upgrade is often a different attention kernel: the appliance records the
backend vLLM reports so /v1/appliance/status and the metrics show it beside the kernel lock's digest.
vLLM logs "Using <NAME> attention backend out of potential backends" (CUDA) or "Using <NAME> backend."
On its CPU platform it logs nothing for ordinary attention, whose only backend there is CPU_ATTN.
"""

from __future__ import annotations

import re

_CHOSEN = (re.compile(r"Using (\w+) attention backend"), re.compile(r"Using (\w+) backend\."))
_DEVICE = re.compile(r"device_config=(\w+)")


class BackendTracker:
    def __init__(self) -> None:
        self.logged: str | None = None
        self.device: str | None = None

    def feed(self, line: str) -> None:
        for pattern in _CHOSEN:
            m = pattern.search(line)
            if m:
                self.logged = m.group(1)
                return
        if self.device is None:
            m = _DEVICE.search(line)
            if m:
                self.device = m.group(1)

    @property
    def backend(self) -> str | None:
        if self.logged:
            return self.logged
        if self.device == "cpu":
            return "CPU_ATTN"
        return None
