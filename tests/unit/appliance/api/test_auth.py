"""API keys and the access-control middleware, against the real app (engine not started: a request
that passes auth reaches the proxy and gets 503 engine_not_ready; one that fails never gets there)."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys

import pytest

from appliance.api.auth import is_loopback, keys_required
from appliance.boot import config
from appliance.store import keys
from tests.unit.appliance.api.inprocess import app as _app
from tests.unit.appliance.api.inprocess import call as _call

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# token_urlsafe's alphabet has "_": about half of all secrets hold one. This one does, early on, so a test
# that cuts the secret at every "_" (as this one once did, and failed when the piece was "B") would see it.
UNDERSCORED = "B_" + "x7Qz" * 10 + "k"


def test_keys_are_stored_hashed_and_shown_once(tmp_path, monkeypatch):
    monkeypatch.setattr(keys.secrets, "token_urlsafe", lambda n: UNDERSCORED)
    db = tmp_path / "a.db"
    key, secret = keys.create(db, "front desk", tenant="clinic", priority_class="gold")
    assert secret == f"apk_{key.id}_{UNDERSCORED}"
    dump = "\n".join(sqlite3.connect(db).iterdump())
    assert UNDERSCORED not in dump and UNDERSCORED[2:] not in dump and key.id in dump
    assert keys.KeyVerifier(db).verify(secret) is not None, "a secret with '_' in it must verify"
    listed = keys.list_keys(db)
    assert [(k.name, k.tenant, k.priority_class, k.active) for k in listed] == [("front desk", "clinic", "gold", True)]
    with pytest.raises(keys.KeyProblem, match="class must be one of"):
        keys.create(db, "x", priority_class="platinum")
    with pytest.raises(keys.KeyProblem, match="no key with id"):
        keys.revoke(db, "nope")


def test_keys_required_on_every_route_but_the_probes(tmp_path):
    cfg, app, log = _app(tmp_path, required=True)
    _, secret = keys.create(cfg.database_path, "app")
    try:
        assert _call(app, "GET", "/healthz").status_code == 200
        assert _call(app, "GET", "/readyz").status_code == 503  # not ready, but no key needed
        assert _call(app, "GET", "/healthz/").status_code in (200, 307)  # a probe written with a slash
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing"),
                             ("GET", "/openapi.json")]:
            r = _call(app, method, path, json=CHAT if method == "POST" else None)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "missing_api_key" and r.headers["www-authenticate"] == "Bearer"
        r = _call(app, "POST", "/v1/chat/completions", key=secret, json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_not_ready"  # past auth
        r = _call(app, "POST", "/v1/chat/completions", key=secret, json=CHAT, header="x-api-key")
        assert r.status_code == 503
        for bad in ("apk_nothere_secret", secret[:-1] + ("A" if secret[-1] != "A" else "B"), "garbage"):
            r = _call(app, "GET", "/v1/models", key=bad)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        log.close()


def test_revoked_key_is_refused(tmp_path):
    cfg, app, log = _app(tmp_path, required=True, ttl=0.0)
    key, secret = keys.create(cfg.database_path, "temp")
    try:
        assert _call(app, "GET", "/v1/models", key=secret).status_code == 503
        keys.revoke(cfg.database_path, key.id)
        r = _call(app, "GET", "/v1/models", key=secret)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        log.close()


def test_admin_scope(tmp_path):
    cfg, app, log = _app(tmp_path, required=True)
    _, user = keys.create(cfg.database_path, "user")
    _, admin = keys.create(cfg.database_path, "ops", admin=True)
    try:
        r = _call(app, "GET", "/v1/appliance/plan", key=user)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_scope_required"
        assert _call(app, "GET", "/v1/appliance/plan", key=admin).json() == {"fits": True}
        assert _call(app, "GET", "/v1/appliance/plan").status_code == 401
    finally:
        log.close()


def test_loopback_without_keys_is_open_and_placeholder_keys_are_anonymous(tmp_path):
    cfg, app, log = _app(tmp_path, required=False)
    key, secret = keys.create(cfg.database_path, "kiosk", priority_class="bronze")
    try:
        assert _call(app, "GET", "/v1/models").status_code == 503
        assert _call(app, "GET", "/v1/appliance/plan").status_code == 200
        # OpenAI clients always send a key; a placeholder must not lock a loopback user out
        assert _call(app, "GET", "/v1/models", key="sk-placeholder").status_code == 503
        assert _call(app, "POST", "/v1/chat/completions", key=secret, json=CHAT).status_code == 503
    finally:
        log.close()
    rows = sqlite3.connect(cfg.database_path).execute("select key_id from requests").fetchall()
    assert rows == [(key.id,)]  # a valid key still counts (tenant, class) on loopback


def test_no_secret_in_logs_or_request_log(tmp_path, caplog):
    cfg, app, log = _app(tmp_path, required=True)
    key, secret = keys.create(cfg.database_path, "app")
    caplog.set_level(logging.DEBUG)
    try:
        _call(app, "POST", "/v1/chat/completions", key=secret, json=CHAT)
        _call(app, "POST", "/v1/chat/completions", key=secret + "x", json=CHAT)
    finally:
        log.close()
    assert secret not in caplog.text
    rows = sqlite3.connect(cfg.database_path).execute("select key_id, status from requests").fetchall()
    assert rows == [(key.id, 503)]  # the refused request never reached the proxy
    assert secret not in "\n".join(sqlite3.connect(cfg.database_path).iterdump())


def test_when_keys_are_required():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert keys_required("auto", "0.0.0.0") and not keys_required("auto", "127.0.0.1")
    assert keys_required("always", "127.0.0.1") and not keys_required("never", "127.0.0.1")
    with pytest.raises(config.ConfigError, match="only allowed on loopback"):
        config.parse('[model]\npath = "/m"\n[server]\nhost = "0.0.0.0"\n[auth]\nrequire_keys = "never"\n')


def test_keys_cli(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n')

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "appliance.cli", "keys", *args, "--config", str(f)],
                              capture_output=True, text=True, timeout=60)

    r = cli("create", "--name", "kiosk", "--class", "bronze", "--tenant", "store-12")
    assert r.returncode == 0 and r.stdout.strip().startswith("apk_") and "shown only now" in r.stderr
    key_id = r.stdout.strip().split("_")[1]
    listed = cli("list")
    assert key_id in listed.stdout and "store-12" in listed.stdout and "active" in listed.stdout
    assert r.stdout.strip() not in listed.stdout
    assert cli("revoke", key_id).returncode == 0
    assert "revoked" in cli("list").stdout
    assert cli("revoke", "missing").returncode == 1
    assert cli("create", "--name", "x", "--class", "platinum").returncode == 2



def test_unknown_key_ids_cost_no_query_and_no_memory(tmp_path):
    """Issue 15: +70 MiB per 20,000 requests with fresh key ids. Issue 30: and a SQLite query on the event
    loop for each. The verifier holds the issued keys only, reloaded as a whole at most once per ttl_s:
    5,000 forged ids cost no reload, and a real key still verifies among them."""
    cfg = config.parse(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n')
    _, secret = keys.create(cfg.database_path, "app")
    verifier = keys.KeyVerifier(cfg.database_path, ttl_s=3600)
    assert verifier.verify(secret) is not None and verifier.reloads == 1
    forged = secret.split("_", 2)
    for i in range(5_000):
        assert verifier.verify(f"{forged[0]}_{i:012x}_{forged[2]}") is None
        if i % 50 == 0:
            assert verifier.verify(secret) is not None
    assert verifier.reloads == 1 and len(verifier._keys) == 1


def test_the_event_loop_never_reads_the_key_table(tmp_path, monkeypatch):
    """verify_async reloads a stale table in a worker thread, one reload shared by concurrent requests;
    a failing reload keeps the table held instead of failing the request."""
    import asyncio
    import sqlite3
    import threading

    cfg = config.parse(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n')
    _, secret = keys.create(cfg.database_path, "app")
    verifier = keys.KeyVerifier(cfg.database_path, ttl_s=3600)
    reload, threads = verifier.reload, []

    def slow_reload():
        threads.append(threading.current_thread())
        import time
        time.sleep(0.2)
        reload()

    monkeypatch.setattr(verifier, "reload", slow_reload)

    async def main():
        loop_thread = threading.current_thread()
        ticks = 0

        async def ticker():  # the loop keeps running while the table loads
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        found = await asyncio.gather(*(verifier.verify_async(secret) for _ in range(20)))
        t.cancel()
        return loop_thread, ticks, found

    loop_thread, ticks, found = asyncio.run(main())
    assert all(k is not None for k in found) and len(threads) == 1 and threads[0] is not loop_thread
    assert ticks >= 5, "the event loop stalled while the keys loaded"

    def broken():
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(verifier, "reload", broken)
    verifier.invalidate()
    assert asyncio.run(verifier.verify_async(secret)) is not None  # the table held still answers
