"""GPU discovery through NVML (the nvidia-ml-py package).

Never raises for a missing driver or GPU: the result says what was found, or
why nothing was, so `appliance plan` and `appliance doctor` can explain it and
planning can go on against a named profile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def supports_fp8(cc: tuple[int, int]) -> bool:
    """FP8 tensor cores (and so FP8 KV cache in vLLM): Ada (8.9), Hopper (9.0), Blackwell."""
    return cc >= (8, 9)


def supports_fp4(cc: tuple[int, int]) -> bool:
    """FP4 (NVFP4) needs Blackwell: compute capability 10.0 or newer."""
    return cc >= (10, 0)


class LowPrecisionFormats:
    """fp8/fp4 support of anything with a compute_capability (a found GPU or a named profile)."""

    compute_capability: tuple[int, int]

    @property
    def fp8(self) -> bool:
        return supports_fp8(self.compute_capability)

    @property
    def fp4(self) -> bool:
        return supports_fp4(self.compute_capability)


@dataclass(frozen=True)
class GpuInfo(LowPrecisionFormats):
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int]
    memory_bus_width_bits: int | None
    max_memory_clock_mhz: int | None
    mig_mode: str  # "enabled", "disabled" or "unsupported"
    other_process_bytes: int
    uuid: str = ""

    @property
    def peak_bandwidth_bytes_s(self) -> float | None:
        """bus width x memory clock x 2 (double data rate); an approximation NVML supports on every card."""
        if not self.memory_bus_width_bits or not self.max_memory_clock_mhz:
            return None
        return self.memory_bus_width_bits / 8 * self.max_memory_clock_mhz * 1e6 * 2

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = f"{self.compute_capability[0]}.{self.compute_capability[1]}"
        d["peak_bandwidth_bytes_s"] = self.peak_bandwidth_bytes_s
        d["fp8"] = self.fp8
        d["fp4"] = self.fp4
        return d


@dataclass(frozen=True)
class Discovery:
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    error: str | None = None  # why nothing was found, for the operator
    problems: tuple[str, ...] = field(default=())

    @property
    def found(self) -> bool:
        return bool(self.gpus)

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpus": [g.as_dict() for g in self.gpus],
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "error": self.error,
            "problems": list(self.problems),
        }


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def discover() -> Discovery:
    try:
        import pynvml
    except ImportError:
        return Discovery(error="nvidia-ml-py is not installed: cannot query NVML")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if getattr(e, "value", None) == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            return Discovery(error="no NVIDIA driver: the NVML library (libnvidia-ml.so) is not installed")
        if getattr(e, "value", None) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            return Discovery(error="no NVIDIA driver loaded: the kernel module is not running")
        return Discovery(error=f"NVML could not start: {e}")
    try:
        driver = _s(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        cuda_s = f"{cuda // 1000}.{cuda % 1000 // 10}"
        gpus = []
        problems = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                gpus.append(_read_device(pynvml, i))
            except pynvml.NVMLError as e:
                problems.append(f"GPU {i}: {e}")
        if not gpus:
            return Discovery(driver_version=driver, cuda_version=cuda_s, error="the driver sees no GPU",
                             problems=tuple(problems))
        return Discovery(tuple(gpus), driver, cuda_s, None, tuple(problems))
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read_device(pynvml: Any, i: int) -> GpuInfo:
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)

    def optional(fn: Any, *args: Any) -> Any:
        try:
            return fn(h, *args)
        except pynvml.NVMLError:
            return None

    mig = optional(pynvml.nvmlDeviceGetMigMode)
    mig_mode = "unsupported" if mig is None else ("enabled" if mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled")
    others = 0
    for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        for p in optional(fn) or []:
            others += int(getattr(p, "usedGpuMemory", 0) or 0)
    return GpuInfo(
        index=i,
        name=_s(pynvml.nvmlDeviceGetName(h)),
        total_bytes=int(mem.total),
        free_bytes=int(mem.free),
        compute_capability=(int(major), int(minor)),
        memory_bus_width_bits=optional(pynvml.nvmlDeviceGetMemoryBusWidth),
        max_memory_clock_mhz=optional(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_MEM),
        mig_mode=mig_mode,
        other_process_bytes=others,
        uuid=_s(optional(pynvml.nvmlDeviceGetUUID) or ""),
    )
