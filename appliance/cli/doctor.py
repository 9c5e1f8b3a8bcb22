"""appliance doctor: the start-up checks, plus the running daemon's live findings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from appliance.boot.net import local_url
from appliance.cli.common import EXIT_FAILED, config_option, load_config


@click.command("doctor")
@config_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-hash", is_flag=True, help="Skip hashing the model folder against its pin (large models).")
@click.option("--no-live", is_flag=True, help="Do not ask the running daemon for its live findings.")
@click.option("--key", envvar="APPLIANCE_API_KEY", default=None,
              help="Admin API key for the live findings when keys are required [env: APPLIANCE_API_KEY].")
def doctor_cmd(config_path: Path | None, as_json: bool, no_hash: bool, no_live: bool, key: str | None) -> None:
    """Check driver and GPU, engine, model and pin, state directory and regional link; with a running
    daemon also its engine and the troubleshooting recipes on live metrics. Exit 1 on any failure."""
    import httpx

    from appliance.boot.startup import StartupError, hash_model
    from appliance.ops import doctor
    from kvbudget.gpu import discover

    cfg = load_config(config_path)
    model_check = None
    unreadable = None
    if not no_hash and cfg.model.path.is_dir():
        try:
            model_check = hash_model(cfg, "hashing model")
        except StartupError as e:
            unreadable = doctor.Finding("model", "fail", str(e))
    findings = doctor.setup_checks(cfg, discover(), model_check)
    if unreadable is not None:
        findings = [unreadable if f.check == "model" else f for f in findings]
    if not no_live:
        url = local_url(cfg.server.host, cfg.server.port, "/v1/appliance/doctor")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            r = httpx.get(url, headers=headers, timeout=30)
            if r.status_code == 200:
                live = [doctor.Finding(**f) for f in r.json()["findings"]]
                setup_names = {f.check for f in findings}
                findings += [f for f in live if f.check not in setup_names]
            else:
                findings.append(doctor.Finding("daemon", "warn", f"the daemon at {url} answered {r.status_code}",
                                               "pass an admin key with --key or APPLIANCE_API_KEY"))
        except httpx.HTTPError:
            findings.append(doctor.Finding("daemon", "skip", f"no daemon answers at {url}: live checks skipped"))
    if as_json:
        click.echo(json.dumps(doctor.as_dict(findings), indent=2))
    else:
        click.echo(doctor.as_text(findings))
    sys.exit(EXIT_FAILED if doctor.worst(findings) == "fail" else 0)
