from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from appliance.boot import config
from appliance.engine.args import build_launch, describe, engine_settings

PLAN = SimpleNamespace(vllm_args=("--kv-cache-memory-bytes", str(3 * 1024**3), "--max-model-len", "4096",
                                  "--max-num-seqs", "8"), max_num_seqs=8)


def _cfg(extra: str = "") -> config.Config:
    return config.parse(
        '[model]\npath = "/models/smol"\nserved_name = "smol"\n[state]\ndirectory = "/var/lib/appliance"\n'
        "[engine]\n" + extra
    )


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_command_line_carries_the_plans_explicit_kv_size_and_limits():
    launch = build_launch(_cfg(), engine_settings(_cfg(), PLAN).args, internal_key="k", base_env={})
    argv = launch.argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--kv-cache-memory-bytes") == str(3 * 1024**3)
    assert _flag(argv, "--max-model-len") == "4096"
    assert _flag(argv, "--max-num-seqs") == "10"  # 8 planned, and 2 for gold's reserve taken back
    assert _flag(argv, "--model") == "/models/smol"
    assert _flag(argv, "--served-model-name") == "smol"
    assert "--enforce-eager" not in argv


def test_engine_has_no_tcp_port_even_when_the_api_listens_everywhere():
    cfg = config.parse('[model]\npath = "/m"\n[server]\nhost = "0.0.0.0"\n')
    launch = build_launch(cfg, engine_settings(cfg, PLAN).args, internal_key="k", base_env={})
    assert "--host" not in launch.argv and "--port" not in launch.argv
    assert _flag(launch.argv, "--uds") == "/var/lib/appliance/engine/api.sock" == str(launch.socket)
    # vLLM's own ZeroMQ sockets go in the same private directory, not /tmp
    assert launch.env["VLLM_RPC_BASE_PATH"] == "/var/lib/appliance/engine"


def test_an_older_configuration_naming_engine_port_still_loads(caplog):
    cfg = config.parse('[model]\npath = "/m"\n[engine]\nport = 8001\nsocket_dir = "/run/x"\n')
    assert cfg.engine_socket == Path("/run/x/api.sock")
    assert "engine.port is no longer used" in caplog.text


def test_environment_is_offline_and_the_key_is_not_on_the_command_line():
    launch = build_launch(_cfg(), engine_settings(_cfg(), PLAN).args, internal_key="sekrit", base_env={"VLLM_CPU_KVCACHE_SPACE": "40", "PATH": "/bin"})
    env = launch.env
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_API_KEY"] == "sekrit"
    assert "sekrit" not in " ".join(launch.argv) and "sekrit" not in describe(launch)
    # It would silently override the explicit pool size on the CPU backend.
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_CACHE_ROOT"] == str(Path("/var/lib/appliance/engine-cache"))
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize("inherited,level", [({}, "INFO"), ({"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_CONFIGURE_LOGGING": "0"},
                                                               "INFO"), ({"VLLM_LOGGING_LEVEL": "debug"}, "debug")])
def test_the_engine_logs_the_info_lines_the_daemon_reads(inherited: dict, level: str):
    """A quieter level inherited (kvbudget/vllm_probe.py sets ERROR where it is imported) would hide the KV
    capacity and kernel lines; the suite's engines started after such an import logged nothing at INFO."""
    env = build_launch(_cfg(), engine_settings(_cfg(), PLAN).args, internal_key="k", base_env=inherited).env
    assert env["VLLM_LOGGING_LEVEL"] == level and env["VLLM_CONFIGURE_LOGGING"] == "1"


def test_extra_args_and_eager_are_appended():
    cfg = _cfg('enforce_eager = true\nextra_args = ["--seed", "7"]\n')
    launch = build_launch(cfg, engine_settings(cfg, PLAN).args, internal_key="k", base_env={})
    assert launch.argv[-3:] == ["--enforce-eager", "--seed", "7"]


def test_admission_turns_on_priority_scheduling_with_room_for_the_reserve_taken_back():
    # The default classes: gold reserves a quarter of 8 slots, 2, which the engine must be able to run
    # beyond the 8 the others may fill.
    argv = build_launch(_cfg(), engine_settings(_cfg(), PLAN).args, internal_key="k", base_env={}).argv
    assert _flag(argv, "--scheduling-policy") == "priority"
    assert _flag(argv, "--max-num-seqs") == "10"
    cfg = config.parse('[model]\npath = "/m"\n[admission]\nenabled = false\n')
    settings = engine_settings(cfg, PLAN)
    argv = build_launch(cfg, settings.args, internal_key="k", base_env={}).argv
    assert "--scheduling-policy" not in argv and _flag(argv, "--max-num-seqs") == "8" and settings.admission is None


def test_the_gate_and_the_engine_get_their_sequences_from_one_computation():
    """The admission the gateway runs and the engine's --max-num-seqs come from one AdmissionConfig."""
    settings = engine_settings(_cfg(), PLAN)
    assert settings.admission is not None and settings.admission.capacity == 8
    assert _flag(settings.args, "--max-num-seqs") == str(settings.admission.engine_max_num_seqs) == "10"
