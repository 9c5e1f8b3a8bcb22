"""appliance keys create|list|revoke: API keys, stored hashed."""

from __future__ import annotations

import json
from pathlib import Path

import click

from appliance.cli.common import EXIT_FAILED, CliError, choice, config_option, load_config
from cascade.policy import PriorityClass


@click.group("keys")
def keys_group() -> None:
    """API keys: stored hashed; each has a tenant, a priority class and optionally the admin scope."""


@keys_group.command("create")
@config_option
@click.option("--name", required=True, help="Who or what uses the key.")
@click.option("--tenant", default="default", show_default=True)
@click.option("--class", "priority_class", type=choice(PriorityClass), default="silver",
              show_default=True, help="Priority class for admission control.")
@click.option("--admin", is_flag=True, help="Also allow /v1/appliance/* and the escalation routes.")
def keys_create(config_path: Path | None, name: str, tenant: str, priority_class: str, admin: bool) -> None:
    """Create a key and print it once (only its hash is stored)."""
    from appliance.store import keys

    cfg = load_config(config_path)
    try:
        key, secret = keys.create(cfg.database_path, name, tenant, priority_class, admin)
    except keys.KeyProblem as e:
        raise CliError(str(e)) from None
    click.echo(f"created key {key.id} ({key.name}, tenant {key.tenant}, class {key.priority_class}"
               f"{', admin' if key.admin else ''}); it is shown only now:", err=True)
    click.echo(secret)


@keys_group.command("list")
@config_option
@click.option("--json", "as_json", is_flag=True)
def keys_list(config_path: Path | None, as_json: bool) -> None:
    """Every key with its id, name, tenant, class, scope and state (never the secret)."""
    from dataclasses import asdict

    from appliance.store import keys

    cfg = load_config(config_path)
    rows = keys.list_keys(cfg.database_path) if cfg.database_path.exists() else []
    if as_json:
        click.echo(json.dumps([asdict(k) for k in rows], indent=2))
        return
    click.echo(f"{'id':14} {'name':20} {'tenant':12} {'class':7} {'admin':5} state")
    for k in rows:
        click.echo(f"{k.id:14} {k.name[:20]:20} {k.tenant[:12]:12} {k.priority_class:7} {k.admin!s:5} "
                   f"{'active' if k.active else 'revoked'}")


@keys_group.command("revoke")
@config_option
@click.argument("key_id")
def keys_revoke(config_path: Path | None, key_id: str) -> None:
    """Revoke a key by its id; the daemon refuses it within 5 seconds."""
    from appliance.store import keys

    cfg = load_config(config_path)
    try:
        key = keys.revoke(cfg.database_path, key_id)
    except keys.KeyProblem as e:
        raise CliError(str(e), EXIT_FAILED) from None
    click.echo(f"revoked {key.id} ({key.name})")
