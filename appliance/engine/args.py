"""Turn the configuration into the vLLM command line and environment.

Pure: takes values, returns values. The supervisor runs what this builds.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from appliance.api.admission import AdmissionConfig
from appliance.boot.config import Config

VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
# What the engine's clients put in their URLs; they reach it over its Unix socket, whatever the host says.
ENGINE_BASE_URL = "http://engine"


@dataclass(frozen=True)
class EngineLaunch:
    argv: list[str]
    env: dict[str, str]
    socket: Path
    internal_key: str = field(repr=False)

    # The host part is only a label: every client of the engine connects through `socket`.
    base_url = ENGINE_BASE_URL


def build_launch(cfg: Config, plan_args: Sequence[str], internal_key: str,
                 base_env: dict[str, str] | None = None, socket: Path | None = None) -> EngineLaunch:
    """The exact child process the supervisor starts: the configuration plus the plan's engine settings.

    plan_args come from kvbudget (--kv-cache-memory-bytes, --max-model-len, --max-num-seqs and,
    where they apply, --kv-cache-dtype, --speculative-config, parallelism), through `engine_settings`: an
    explicit pool size, so the engine never profiles and guesses differently from the plan.
    """
    e = cfg.engine
    python = e.python or sys.executable
    # Its own socket when given (the supervisor gives each engine one, as two run during an upgrade);
    # cfg.engine_socket then links to the serving one.
    socket = socket or cfg.engine_socket
    argv = [
        python,
        "-m",
        VLLM_ENTRYPOINT,
        "--model",
        str(cfg.model.path),
        "--served-model-name",
        cfg.served_name,
        # No TCP port: a Unix socket in a directory only the service user can enter, so nobody but the
        # appliance reaches the engine (vLLM's key guards only some of its routes).
        "--uds",
        str(socket),
        *plan_args,
        # The appliance keeps its own per-request log; vLLM's access log would duplicate it.
        "--disable-uvicorn-access-log",
    ]
    if e.enforce_eager:
        argv.append("--enforce-eager")
    argv.extend(e.extra_args)

    env = engine_env(os.environ if base_env is None else base_env, cfg.engine_cache_dir, cfg.engine_socket.parent)
    # Passed by environment, not argv, so it does not show in `ps`.
    env["VLLM_API_KEY"] = internal_key
    return EngineLaunch(argv=argv, env=env, socket=socket, internal_key=internal_key)


def engine_env(base_env: Mapping[str, str], cache_root: Path, rpc_dir: Path) -> dict[str, str]:
    """A vLLM server's environment: `base_env` made offline and private (the tests' regional servers use it too)."""
    env = dict(base_env)
    env.update(
        {
            # No model hub, ever: models load from local paths only.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(cache_root),
            "PYTHONUNBUFFERED": "1",
            # vLLM's ZeroMQ sockets between its API server and engine core are files in this directory
            # (default: /tmp, where any local user could connect to them): a private one instead.
            "VLLM_RPC_BASE_PATH": str(rpc_dir),
        }
    )
    # VLLM_CPU_KVCACHE_SPACE silently overrides --kv-cache-memory-bytes on the CPU
    # backend (docs/engine-notes.md); the planned figure must win.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # The daemon reads vLLM's INFO lines (the KV capacity it checks against the plan, the attention backend,
    # the weight kernel): a quieter level inherited from the environment would blind it. DEBUG is kept.
    env["VLLM_CONFIGURE_LOGGING"] = "1"
    if env.get("VLLM_LOGGING_LEVEL", "INFO").upper() != "DEBUG":
        env["VLLM_LOGGING_LEVEL"] = "INFO"
    return env


class PlannedEngine(Protocol):
    """What engine_settings reads of a plan (kvbudget.plan_types.Plan)."""

    @property
    def vllm_args(self) -> Sequence[str]: ...

    @property
    def max_num_seqs(self) -> int: ...


@dataclass(frozen=True)
class EngineSettings:
    """What one plan gives the engine and the gateway, computed once (`engine_settings`): the engine's
    command-line settings and the admission the gateway runs in front of it (None: admission off)."""

    args: list[str]
    admission: AdmissionConfig | None


def engine_settings(cfg: Config, plan: PlannedEngine) -> EngineSettings:
    """The plan's engine settings with what admission needs of the engine: vLLM's priority scheduling, so
    the gateway's `priority` field (from the request's class) orders the engine's queue and picks who is
    preempted, and room for the sequences a class takes back over the capacity when it returns to its lent
    reserve (appliance.api.admission). The one place the engine's sequence count is decided: the gate is
    built from the same AdmissionConfig.

    vLLM (0.32) never preempts to free a sequence slot, only KV blocks: without that room a returning gold
    request would wait in the engine for a whole lower-class answer.
    """
    args = list(plan.vllm_args)
    if not cfg.admission.enabled:
        return EngineSettings(args, None)
    admission = AdmissionConfig.from_section(cfg.admission, plan.max_num_seqs)
    if "--max-num-seqs" in args:
        i = args.index("--max-num-seqs") + 1
        args[i] = str(max(plan.max_num_seqs, admission.engine_max_num_seqs))
    # Whatever the sequence count: the gateway sets `priority` whenever admission is on, which vLLM
    # refuses under any other policy.
    return EngineSettings([*args, "--scheduling-policy", "priority"], admission)


def describe(launch: EngineLaunch) -> str:
    """The command line as an operator would type it (no secrets: the key is in env)."""
    return shlex.join(launch.argv)
