"""appliance escalations ... and appliance requests: what the daemon wrote to its state directory."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from appliance.cli.common import EXIT_FAILED, CliError, choice, config_option, load_config
from cascade.outbox import FINISHED, Status


@click.group("escalations")
def escalations_group() -> None:
    """The escalation outbox: list, show, retry failed ones, purge finished ones.

    Works beside the running daemon (SQLite WAL); the daemon's forwarder picks up retried rows."""


def _outbox(config_path: Path | None):
    from appliance.boot.escalation import OUTBOX_FILE, open_outbox

    cfg = load_config(config_path)
    if not (cfg.state.directory / OUTBOX_FILE).exists():
        click.echo(f"no escalation outbox yet at {cfg.state.directory / OUTBOX_FILE}", err=True)
        sys.exit(0)
    return open_outbox(cfg)


@escalations_group.command("list")
@config_option
@click.option("--status", type=choice(Status), default=None)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100000))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def escalations_list(config_path: Path | None, status: str | None, limit: int, as_json: bool) -> None:
    """Newest first, without prompt or answer text; a summary of the outbox at the end."""
    box = _outbox(config_path)
    rows = box.list(status, None, limit)
    if as_json:
        for e in rows:
            click.echo(json.dumps(e.summary()))
    else:
        click.echo(f"{'id':40} {'status':8} {'tries':>5} {'sends':>5} {'age':>8}  reason")
        now = time.time()
        for e in rows:
            click.echo(f"{e.id:40} {e.status:8} {e.attempts:>5} {e.sends:>5} {_age(now - e.created):>8}  "
                       f"{e.reason[:60]}")
    st = box.stats()
    click.echo(f"outbox: {st['depth']} waiting (oldest {_age(st['oldest_age_s'])}), "
               + ", ".join(f"{k} {v}" for k, v in st["counts"].items()), err=True)


@escalations_group.command("show")
@config_option
@click.argument("esc_id")
def escalations_show(config_path: Path | None, esc_id: str) -> None:
    """One escalation in full: the request as sent over the link and the regional answer."""
    e = _outbox(config_path).get(esc_id)
    if e is None:
        raise CliError(f"no escalation with id {esc_id}", EXIT_FAILED)
    click.echo(json.dumps({**e.summary(), "request": e.request, "answer": e.answer}, indent=2))


@escalations_group.command("retry")
@config_option
@click.argument("ids", nargs=-1)
@click.option("--all-failed", is_flag=True, help="Every failed or expired escalation.")
def escalations_retry(config_path: Path | None, ids: tuple[str, ...], all_failed: bool) -> None:
    """Put failed or expired escalations back in the queue."""
    if not ids and not all_failed:
        raise CliError("name escalation ids or pass --all-failed")
    n = _outbox(config_path).retry(None if all_failed else ids)
    click.echo(f"queued {n} escalation(s) again")
    if ids and n < len(ids):
        sys.exit(EXIT_FAILED)


@escalations_group.command("purge")
@config_option
@click.option("--status", "statuses", multiple=True, default=FINISHED[:1], show_default=True,
              type=click.Choice(list(FINISHED)))
@click.option("--older-than-days", type=click.FloatRange(0), default=0.0, show_default=True)
def escalations_purge(config_path: Path | None, statuses: tuple[str, ...], older_than_days: float) -> None:
    """Delete finished escalations (never waiting ones)."""
    n = _outbox(config_path).purge(statuses, older_than_days * 86400)
    click.echo(f"purged {n} escalation(s)")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@click.command("requests")
@config_option
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 10000))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def requests_cmd(config_path: Path | None, limit: int, as_json: bool) -> None:
    """Show the most recent requests from the request log."""
    from appliance.store.requests import recent_requests

    cfg = load_config(config_path)
    if not cfg.database_path.exists():
        click.echo(f"no request log yet at {cfg.database_path}", err=True)
        return
    rows = recent_requests(cfg.database_path, limit)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
        return
    click.echo(f"{'id':38} {'status':>6} {'stream':>6} {'prompt':>6} {'compl':>6} {'ttft_ms':>8} {'total_ms':>9}  route")
    for r in rows:
        click.echo(
            f"{r['id']:38} {r['status']:>6} {bool(r['stream'])!s:>6} {_n(r['prompt_tokens']):>6} "
            f"{_n(r['completion_tokens']):>6} {_n(r['ttft_ms'], 1):>8} {_n(r['total_ms'], 1):>9}  {r['route']}"
        )


def _n(v: float | int | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if digits else str(v)
