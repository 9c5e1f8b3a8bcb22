from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from appliance.boot import config
from appliance.boot.startup import runtime_problems
from tests.support import EMPTY_SAFETENSORS, REPO

MINIMAL = '[model]\npath = "models/m"\n'


def test_minimal_file_gets_documented_defaults(tmp_path: Path):
    cfg = config.parse(MINIMAL, base=tmp_path)
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8000
    assert cfg.model.path == (tmp_path / "models/m").resolve()
    assert cfg.served_name == "m"
    assert cfg.engine.kv_cache_memory_bytes is None  # from the plan
    assert cfg.targets.workload == "chat" and cfg.targets.kv_dtype == "auto"
    assert cfg.database_path == Path("/var/lib/appliance/appliance.db")
    assert cfg.policy.escalate == "never" and cfg.auth.require_keys == "auto"


def test_sizes_accept_units(tmp_path: Path):
    cfg = config.parse(MINIMAL + '[engine]\nkv_cache_memory_bytes = "2GiB"\n[server]\nmax_body_bytes = "64KB"\n')
    assert int(cfg.engine.kv_cache_memory_bytes) == 2 * 1024**3
    assert int(cfg.server.max_body_bytes) == 64_000


def test_home_is_expanded_and_relative_paths_follow_the_file(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config.parse('[model]\npath = "~/m"\n[state]\ndirectory = "st"\n', base=tmp_path / "etc")
    assert cfg.model.path == tmp_path / "m"
    assert cfg.state.directory == (tmp_path / "etc" / "st").resolve()


@pytest.mark.parametrize(
    "text, key, hint",
    [
        (MINIMAL + "[server]\nport = 70000\n", "server.port", "less than or equal to 65535"),
        (MINIMAL + "[engine]\nmax_num_seqs = 0\n", "engine.max_num_seqs", "greater than or equal to 1"),
        (MINIMAL + '[engine]\nkv_cache_memory_bytes = "lots"\n', "engine.kv_cache_memory_bytes", "byte size"),
        (MINIMAL + '[policy]\nescalate = "sometimes"\n', "policy.escalate", "'never', 'auto' or 'always'"),
        (MINIMAL + "[server]\nprot = 1\n", "server.prot", "allowed here: host, port"),
        (MINIMAL + "[surver]\nport = 1\n", "surver", "allowed here: site, model, server"),
        ("[server]\nport = 1\n", "model", "required but missing"),
        (MINIMAL + '[engine]\nextra_args = ["--port=9"]\n', "engine.extra_args", "set by the appliance"),
        (MINIMAL + '[regional]\nenabled = true\nbase_url = "ftp://x"\n', "regional", "http:// or https://"),
    ],
)
def test_invalid_values_name_the_key_and_what_is_allowed(text: str, key: str, hint: str):
    with pytest.raises(config.ConfigError) as exc:
        config.parse(text, source="site.toml")
    msg = str(exc.value)
    assert "site.toml" in msg and f"  {key}:" in msg and hint in msg


def test_malformed_toml_says_where():
    with pytest.raises(config.ConfigError, match=r"not valid TOML.*line 2"):
        config.parse('[model]\npath = "unterminated\n', source="x.toml")


def test_missing_file_says_how_to_point_at_one(tmp_path: Path):
    with pytest.raises(config.ConfigError, match=r"does not exist; pass --config PATH or set APPLIANCE_CONFIG"):
        config.load(tmp_path / "nope.toml")


def test_environment_chooses_the_file(tmp_path: Path, monkeypatch):
    f = tmp_path / "a.toml"
    f.write_text('[model]\npath = "/models/x"\nserved_name = "from-env"\n')
    monkeypatch.setenv("APPLIANCE_CONFIG", str(f))
    assert config.load().served_name == "from-env"
    assert config.config_path("explicit.toml") == Path("explicit.toml")
    monkeypatch.delenv("APPLIANCE_CONFIG")
    assert config.config_path() == Path("/etc/appliance/appliance.toml")


def test_runtime_check_reports_missing_model_folder(tmp_path: Path):
    cfg = config.parse(f'[model]\npath = "{tmp_path}/absent"\n[state]\ndirectory = "{tmp_path}/s"\n')
    problems = [str(p) for p in runtime_problems(cfg)]
    assert len(problems) == 1 and "not a folder" in problems[0] and "install-default" in problems[0]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance.cli", *args], capture_output=True, text=True, timeout=60)


def test_config_check_command(tmp_path: Path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    good = tmp_path / "good.toml"
    good.write_text('[model]\npath = "m"\n[state]\ndirectory = "state"\n')
    r = _cli("config", "check", "--config", str(good))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr

    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npath = "m"\n[engine]\nmax_model_len = "long"\n')
    r = _cli("config", "check", "--config", str(bad))
    assert r.returncode == 2 and "engine.max_model_len" in r.stderr and "Traceback" not in r.stderr

    r = _cli("config", "check", "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr

    empty = tmp_path / "empty-model.toml"
    empty.write_text(f'[model]\npath = "{tmp_path}/nothing"\n')
    r = _cli("config", "check", "--config", str(empty))
    assert r.returncode == 1 and "model.path" in r.stderr


def test_serve_refuses_a_missing_model_before_starting_anything(tmp_path: Path):
    f = tmp_path / "a.toml"
    f.write_text(f'[model]\npath = "{tmp_path}/nothing"\n[state]\ndirectory = "{tmp_path}/s"\n')
    r = _cli("serve", "--config", str(f))
    assert r.returncode == 2 and "model.path" in r.stderr and "install-default" in r.stderr


def test_the_annotated_example_is_a_valid_configuration():
    doc = (REPO / "docs" / "operations.md").read_text()
    block = doc.split("## A configuration, annotated", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = config.parse(block, source="docs/operations.md")
    assert cfg.served_name == "smollm2-135m-instruct" and cfg.targets.workload == "chat"
    assert cfg.policy.tenants["clinic"].local_only and cfg.policy.thresholds.quantile_logprob == -1.6
    assert cfg.admission.classes["gold"].reserved_share == 0.25 and cfg.kernels.verify == "warn"


def test_runtime_check_accepts_a_state_directory_it_will_create(tmp_path: Path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    cfg = config.parse(f'[model]\npath = "{model}"\n[state]\ndirectory = "{tmp_path}/not/yet/there"\n')
    assert [str(p) for p in runtime_problems(cfg)] == []
    blocked = tmp_path / "file"
    blocked.write_text("")
    cfg = config.parse(f'[model]\npath = "{model}"\n[state]\ndirectory = "{blocked}/state"\n')
    assert "cannot be created" in next(str(p) for p in runtime_problems(cfg))


# -- appliance init ------------------------------------------------------------------------------


def test_init_writes_a_valid_private_configuration_and_token(tmp_path):
    import os
    import stat

    from click.testing import CliRunner

    from appliance.cli import main

    out, token = tmp_path / "etc" / "appliance.toml", tmp_path / "etc" / "regional.token"
    r = CliRunner().invoke(main, [
        "init", "--site-name", "store-042", "--model-path", str(tmp_path / "model"), "--regional-url",
        "https://regional.example/v1", "--regional-model", "big-model", "--token-file", str(token), "--token-stdin",
        "--escalate", "auto", "--engine-python", "", "--state-dir", str(tmp_path / "state"), "--output", str(out)],
        input="s3cret-token\n")
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640 and stat.S_IMODE(os.stat(token).st_mode) == 0o600
    assert token.read_text().strip() == "s3cret-token" and "s3cret" not in out.read_text() + r.output
    cfg = config.load(out)
    assert cfg.site.name == "store-042" and cfg.regional.enabled and cfg.regional.model == "big-model"
    assert cfg.regional.token_file == token and cfg.policy.escalate == "auto"
    assert cfg.kernels.verify == "fail" and cfg.model.verify == "fail" and cfg.server.host == "0.0.0.0"
    assert "model.path" in r.output  # the missing model folder is named as the next thing to fix
    again = CliRunner().invoke(main, ["init", "--site-name", "x", "--model-path", "/m", "--regional-url", "",
                                      "--output", str(out)])
    assert again.exit_code == 2 and "--force" in again.output


def test_init_refuses_answers_that_make_a_bad_configuration(tmp_path):
    from click.testing import CliRunner

    from appliance.cli import main

    r = CliRunner().invoke(main, ["init", "--site-name", "x", "--model-path", str(tmp_path), "--regional-url",
                                  "ftp://nope", "--regional-model", "m", "--output", str(tmp_path / "a.toml")])
    assert r.exit_code == 2 and "base_url" in r.output and not (tmp_path / "a.toml").exists()
