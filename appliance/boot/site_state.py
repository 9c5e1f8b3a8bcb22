"""What changes while the daemon runs, in one place: the configuration (SIGHUP) and the plan (remedies)."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.boot.config import Config
from appliance.boot.model_pin import ModelCheck
from appliance.boot.planning import SitePlan
from kernels.lock import KernelCheck


@dataclass
class SiteState:
    cfg: Config  # as the file says: a reload replaces the live sections only
    site_plan: SitePlan  # what the engine runs now
    model_check: ModelCheck | None = None  # the start-up checks' results, hashed once
    kernel_check: KernelCheck | None = None
    speculation_off: str | None = None  # why the daemon turned speculative decoding off, if it did
    model_build: dict | None = None  # the build.json of a build `appliance model quantize` made, if it is one
