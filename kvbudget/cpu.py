"""The CPU as a device: the instruction-set level a host offers, as vLLM's CPU backend tells hosts apart.

vLLM's CPU platform asks PyTorch (torch.cpu._is_avx512_supported and friends) what the host can run, and
four answers change the KV cache it allocates or what it refuses:

| level         | host examples                          | what vLLM does differently                                |
|---------------|----------------------------------------|-----------------------------------------------------------|
| `avx2`        | Haswell to Comet Lake, Zen 1-3         | FP8 KV refused; recurrent state in the model's dtype      |
| `avx512`      | Skylake-SP, Cascade Lake, Ice Lake     | FP8 KV allowed                                            |
| `avx512-bf16` | Cooper Lake, Zen 4/5                   | and the Mamba/GDN recurrent state stored in float32       |
| `amx`         | Sapphire Rapids and newer Xeons        | and AMX_MLA (128-token blocks, prefix caching kept) for   |
|               |                                        | MLA models; block-FP8 and MXFP4 MoE weight kernels        |

PyTorch reads the same CPUID bits that Linux lists in /proc/cpuinfo (aten/src/ATen/cpu/Utils.cpp):
AVX-512 is avx512f, avx512vl, avx512bw and avx512dq together; BF16 is avx512_bf16; AMX is amx_tile.
kvbudget/vllm_probe.py emulates each level by giving vLLM PyTorch's answers for it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

CpuIsa = Literal["avx2", "avx512", "avx512-bf16", "amx"]
CPU_ISAS: tuple[CpuIsa, ...] = get_args(CpuIsa)  # in order: each level has what the one before it has

AVX512_FLAGS = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq"})
# Tests (and an operator checking a what-if on the real engine's host) can make this host read as another
# level; the vLLM probe then emulates that level for "this machine" too.
FORCE_ENV = "KVBUDGET_HOST_CPU_ISA"


class CpuIsaError(ValueError):
    """Not a level vLLM's CPU backend is planned for."""


def check_isa(name: str) -> CpuIsa:
    if name not in CPU_ISAS:
        raise CpuIsaError(f"unknown CPU instruction set {name!r} (known: {', '.join(CPU_ISAS)})")
    return name


def at_least(isa: CpuIsa, level: CpuIsa) -> bool:
    return CPU_ISAS.index(isa) >= CPU_ISAS.index(level)


def has_avx512(isa: CpuIsa) -> bool:
    return at_least(isa, "avx512")


def has_avx512_bf16(isa: CpuIsa) -> bool:
    return at_least(isa, "avx512-bf16")


def has_amx(isa: CpuIsa) -> bool:
    return isa == "amx"


def isa_from_flags(flags: set[str] | frozenset[str]) -> CpuIsa:
    """The level a set of /proc/cpuinfo flags gives, by PyTorch's definitions."""
    if "amx_tile" in flags:
        return "amx"
    if flags >= AVX512_FLAGS:
        return "avx512-bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags (every core of a host has the same)."""
    for line in cpuinfo.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def host_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuIsa:
    """This host's level, or the one KVBUDGET_HOST_CPU_ISA names (to plan as if on another host)."""
    forced = os.environ.get(FORCE_ENV)
    if forced:
        return check_isa(forced)
    try:
        return isa_from_flags(cpu_flags(cpuinfo))
    except OSError:
        return "avx2"  # no /proc/cpuinfo (not Linux): the level every x86-64 vLLM build runs on


# -- what vLLM's CPU backend does at each level (vllm/platforms/cpu.py, v1/attention/backends/cpu_attn.py) --


def mla_block_size(isa: CpuIsa) -> int:
    """CpuPlatform.check_and_update_config: AMX_MLA takes the CPU default of 128 tokens; the reference
    CPU_MLA backend's decode kernel compiles only for 16."""
    return 128 if has_amx(isa) else 16


def mla_keeps_prefix_caching(isa: CpuIsa) -> bool:
    """Without AMX, vLLM turns prefix caching and chunked prefill off for MLA models."""
    return has_amx(isa)


def state_dtype_bytes(isa: CpuIsa) -> int | None:
    """The recurrent (SSM) state's bytes per element, or None for the model's own dtype: with AVX512-BF16
    vLLM's accelerated Mamba/GDN kernels reset the SSM cache dtype to float32."""
    return 4 if has_avx512_bf16(isa) else None


def kv_dtype_refusal(want: str, head_dim: int, mla: bool, isa: CpuIsa) -> str | None:
    """Why FP8 KV cannot run on this host's CPU backend, or None when it can (vLLM's _get_attn_isa, and
    the MLA backends' declared KV dtypes)."""
    if want == "fp4":
        return "FP4 KV cache is a Blackwell GPU format; vLLM's CPU backend has no FP4 KV"
    if want != "fp8":
        return None
    if mla:
        return ("vLLM's CPU MLA backends (CPU_MLA, AMX_MLA) declare only a 16-bit latent cache: "
                "FP8 KV is not available for MLA models on the CPU")
    if not has_avx512(isa):
        return f"FP8 KV cache on the CPU needs AVX-512 or AMX (vLLM's words); this host is {isa}"
    if head_dim % 32:
        return f"FP8 KV cache on the CPU needs a head size divisible by 32; this model's is {head_dim}"
    return None


def _format_parts(weight_format: str) -> set[str]:
    """ModelShape.weight_format ("method/algo/format[+block]") as its parts."""
    return set(weight_format.replace("+", "/").split("/"))


def weight_kernel_refusal(weight_format: str, isa: CpuIsa) -> str | None:
    """Why vLLM's CPU build has no kernel for a checkpoint's weights on this host, or None.

    weight_format is ModelShape.weight_format. vLLM 0.32's CPU build: block-scaled FP8 linear layers
    (CPUFp8BlockScaledMMKernel) and MXFP4 MoE experts need AMX tiles; NVFP4 has no CPU kernel. Per-channel
    FP8, AWQ/GPTQ and compressed-tensors integer formats have kernels at every level.
    """
    parts = _format_parts(weight_format)
    if any("nvfp4" in p for p in parts):
        return "NVFP4 weights have no kernel in vLLM's CPU build (a Blackwell GPU format)"
    if "mxfp4" in parts and not has_amx(isa):
        return f"MXFP4 MoE weights need AMX on vLLM's CPU backend; this host is {isa}"
    if "fp8" in parts and "block" in parts and not has_amx(isa):
        return f"block-scaled FP8 weights need AMX tiles on vLLM's CPU backend; this host is {isa}"
    return None


def weight_kernel_note(weight_format: str) -> str | None:
    """What a plan should say of weights vLLM's CPU build serves, but slowly: per-channel FP8 (FP8_DYNAMIC,
    compressed-tensors' float-quantized) has no CPU matrix kernel, and its products fall back to
    torch._scaled_mm, about one token per 50 s for a 135M model in a trial on an AMX Xeon. The block-scaled
    FP8 kernel is the AMX one weight_kernel_refusal allows."""
    parts = _format_parts(weight_format)
    if ("float-quantized" in parts or "fp8" in parts) and "block" not in parts:
        return ("per-channel FP8 weights load on vLLM's CPU build but have no CPU matrix kernel (torch._scaled_mm: "
                "about a token per 50 s for a 135M model): for a CPU host, build w8a8-int8 or w4a16 from the "
                "unquantized model with `appliance model quantize`")
    return None
