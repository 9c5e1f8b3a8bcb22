"""Named GPU profiles, for planning on a machine without the GPU (or without any GPU).

Memory is the total NVML reports for the card where known (the RTX PRO 6000 Blackwell shows
97,887 MiB, not 96 GiB and not 96 GB); otherwise the nominal size, marked as such.
Bandwidth is the vendor's peak figure. FP8 KV needs compute capability 8.9 or newer (Ada,
Hopper, Blackwell); FP4 KV needs Blackwell (10.0 or newer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbudget.gpu import GpuInfo, LowPrecisionFormats

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class GpuProfile(LowPrecisionFormats):
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float
    compute_capability: tuple[int, int]
    memory_is_nvml_total: bool
    aliases: tuple[str, ...] = ()
    kind: str = "workstation"


PROFILES: tuple[GpuProfile, ...] = (
    GpuProfile("RTX PRO 6000 Blackwell", 97_887 * MiB, 1792e9, (12, 0), True,
               ("rtx pro 6000", "rtx pro 6000 blackwell workstation edition", "rtx pro 6000 blackwell server edition")),
    GpuProfile("RTX 6000 Ada", 49_140 * MiB, 960e9, (8, 9), True, ("rtx 6000 ada generation",)),
    GpuProfile("RTX A6000", 49_140 * MiB, 768e9, (8, 6), True, ("a6000",)),
    GpuProfile("RTX 5090", 32_607 * MiB, 1792e9, (12, 0), True, ("geforce rtx 5090",)),
    GpuProfile("RTX 4090", 24_564 * MiB, 1008e9, (8, 9), True, ("geforce rtx 4090",)),
    GpuProfile("DGX Spark", 128 * GiB, 273e9, (12, 1), False, ("gb10",), kind="deskside superchip"),
    GpuProfile("L4", 23_034 * MiB, 300e9, (8, 9), True, (), kind="data-centre"),
    GpuProfile("L40S", 46_068 * MiB, 864e9, (8, 9), True, (), kind="data-centre"),
    GpuProfile("A100 80GB", 81_920 * MiB, 2039e9, (8, 0), True, ("a100-sxm4-80gb", "a100 80gb pcie"), kind="data-centre"),
    GpuProfile("H100 80GB", 81_559 * MiB, 3350e9, (9, 0), True, ("h100", "h100 80gb hbm3", "h100 sxm"), kind="data-centre"),
    GpuProfile("H200", 143_771 * MiB, 4800e9, (9, 0), True, ("h200 141gb", "h200 nvl"), kind="data-centre"),
    GpuProfile("B200", 183_359 * MiB, 8000e9, (10, 0), False, (), kind="data-centre"),
)


class UnknownGpu(ValueError):
    pass


def _norm(s: str) -> str:
    s = s.lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", " ", s).strip()


def find_profile(name: str) -> GpuProfile:
    """A profile by its name, an alias, or the name NVML reports (case and punctuation ignored)."""
    want = _norm(name)
    if not want:
        raise UnknownGpu("empty GPU name")
    for p in PROFILES:
        if want == _norm(p.name) or want in (_norm(a) for a in p.aliases):
            return p
    # NVML names carry suffixes ("NVIDIA H100 80GB HBM3"): the longest profile name contained wins.
    contained = [p for p in PROFILES if any(_norm(n) in want for n in (p.name, *p.aliases))]
    if contained:
        return max(contained, key=lambda p: max(len(_norm(n)) for n in (p.name, *p.aliases) if _norm(n) in want))
    raise UnknownGpu(
        f"unknown GPU {name!r}; known: {', '.join(p.name for p in PROFILES)}. "
        "For another card pass --gpu-memory (and --gpu-cc for its compute capability)."
    )


def profile_from_discovery(info: GpuInfo) -> GpuProfile:
    """A found GPU as a profile: NVML's exact memory, the table's bandwidth when known."""
    try:
        known = find_profile(info.name)
        bandwidth = known.bandwidth_bytes_s
    except UnknownGpu:
        bandwidth = info.peak_bandwidth_bytes_s or 0.0
    return GpuProfile(info.name, info.total_bytes, bandwidth, info.compute_capability, True)


def custom_profile(memory_bytes: int, compute_capability: tuple[int, int] = (8, 0), name: str = "custom GPU") -> GpuProfile:
    if memory_bytes <= 0:
        raise ValueError(f"GPU memory must be positive (got {memory_bytes} bytes)")
    return GpuProfile(name, memory_bytes, 0.0, compute_capability, False)
