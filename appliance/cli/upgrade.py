"""appliance upgrade | rollback | versions: asks the running daemon (admin API), then follows the steps."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from appliance.boot.net import local_url
from appliance.cli.common import EXIT_FAILED, CliError, config_option, load_config

key_option = click.option("--key", envvar="APPLIANCE_API_KEY", default=None,
                          help="Admin API key when keys are required [env: APPLIANCE_API_KEY].")
POLL_S = 1.0
swap_option = click.option("--swap", type=click.Choice(["auto", "beside", "in-place"]), default=None,
                           help="Start the new engine beside the running one (no request waits; needs memory "
                                "for both) or in its place (requests held); default: upgrade.swap.")


class _Daemon:
    """The running daemon's upgrade routes."""

    def __init__(self, config_path: Path | None, key: str | None) -> None:
        import httpx

        cfg = load_config(config_path)
        self.base = local_url(cfg.server.host, cfg.server.port, "/v1/appliance")
        self.client = httpx.Client(headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        import httpx

        try:
            r = self.client.request(method, self.base + path, json=body)
        except httpx.HTTPError as e:
            raise CliError(f"no daemon answers at {self.base}{path} ({e}); is the service running?",
                           EXIT_FAILED) from None
        try:
            data = r.json()
        except ValueError:
            data = {}
        if r.status_code >= 400:
            msg = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            hint = " (pass an admin key with --key or APPLIANCE_API_KEY)" if r.status_code in (401, 403) else ""
            raise CliError(f"{msg or r.text}{hint}", EXIT_FAILED)
        return data


def _follow(daemon: _Daemon, started: dict[str, Any]) -> None:
    """Print each step as the daemon takes it, then the outcome; exit 1 unless it committed."""
    attempt_id, shown = started["id"], 0
    while True:
        st = daemon.call("GET", "/upgrade")
        running = st.get("running")
        steps = running["steps"] if running and running["id"] == attempt_id else []
        for s in steps[shown:]:
            verdict = f" [{s['verdict']}]" if s.get("verdict") else ""
            click.echo(f"  {s['step']:<9} {s['message']}{verdict}")
        shown = max(shown, len(steps))
        last = st.get("last")
        if (running is None or running["id"] != attempt_id) and last and last["id"] == attempt_id:
            click.echo(f"{last['kind']} {last['result'].replace('_', ' ')} at {last['step']}: {last['reason']}")
            click.echo(f"committed: {st['committed']}")
            sys.exit(0 if last["result"] == "committed" else EXIT_FAILED)
        time.sleep(POLL_S)


@click.command("upgrade")
@config_option
@click.option("--model", "model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The new model folder.")
@click.option("--digest", default=None, help="The new model's pin (`appliance model pin` prints it); needed unless "
                                             "the folder holds its pin manifest.")
@click.option("--engine-python", default=None, help="The interpreter of another engine environment.")
@click.option("--kernels-lock", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="That environment's kernel lock (`appliance kernels lock`).")
@swap_option
@click.option("--no-wait", is_flag=True, help="Start it and return; follow it with `appliance versions`.")
@key_option
def upgrade_cmd(config_path: Path | None, model: Path | None, digest: str | None, engine_python: str | None,
                kernels_lock: Path | None, swap: str | None, no_wait: bool, key: str | None) -> None:
    """Change the running box's model, engine or both: stage (pins, plan), swap (requests held), gate (the
    golden set), probation, commit; any failure rolls back by itself. Exit 1 unless it committed."""
    body = {"model": str(model.resolve()) if model else None, "digest": digest,
            "engine_python": engine_python, "kernels_lock": str(kernels_lock.resolve()) if kernels_lock else None,
            "swap": swap.replace("-", "_") if swap else None}
    daemon = _Daemon(config_path, key)
    started = daemon.call("POST", "/upgrade", {k: v for k, v in body.items() if v is not None})["started"]
    click.echo(f"upgrade {started['id']}: {started['from']} -> {started['target']}")
    if not no_wait:
        _follow(daemon, started)


@click.command("rollback")
@config_option
@swap_option
@click.option("--no-wait", is_flag=True, help="Start it and return.")
@key_option
def rollback_cmd(config_path: Path | None, swap: str | None, no_wait: bool, key: str | None) -> None:
    """Go back to the version committed before the current one (the same steps as an upgrade, without the
    agreement check). Exit 1 unless it committed."""
    daemon = _Daemon(config_path, key)
    started = daemon.call("POST", "/rollback", {"swap": swap.replace("-", "_")} if swap else None)["started"]
    click.echo(f"rollback {started['id']}: {started['from']} -> {started['target']}")
    if not no_wait:
        _follow(daemon, started)


@click.command("versions")
@config_option
@click.option("--json", "as_json", is_flag=True)
@key_option
def versions_cmd(config_path: Path | None, as_json: bool, key: str | None) -> None:
    """The committed version, the one before it, the last upgrade's outcome and any under way."""
    st = _Daemon(config_path, key).call("GET", "/upgrade")
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    click.echo(f"committed: {st['committed']}\nprevious:  {st['previous'] or '-'}")
    if st.get("running"):
        r = st["running"]
        click.echo(f"under way: {r['kind']} {r['id']} to {r['target']} ({r['step']})")
    if st.get("last"):
        last = st["last"]
        click.echo(f"last:      {last['kind']} {last['id']} {last['result']} at {last['step']}: {last['reason']}")
