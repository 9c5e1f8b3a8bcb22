"""API keys: created once and shown once, stored hashed, revocable.

A key reads `apk_<id>_<secret>`: the id is public (it names the key in lists and logs), the secret is
32 random bytes. Only sha256(secret) is stored. The secret has 256 bits of entropy, so a fast hash is
enough (a password hash such as scrypt protects low-entropy secrets, which these are not), and the
comparison is constant-time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from appliance.store.requests import open_db
from cascade.policy import PRIORITY_CLASSES

log = logging.getLogger("appliance")

PREFIX = "apk"


class KeyProblem(ValueError):
    pass


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    tenant: str
    priority_class: str
    admin: bool
    created: float
    revoked: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked is None


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse(presented: str) -> tuple[str, str] | None:
    parts = presented.split("_", 2)  # the secret itself may contain "_"
    if len(parts) != 3 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def _row_to_key(r: dict) -> ApiKey:
    return ApiKey(r["id"], r["name"], r["tenant"], r["priority_class"], bool(r["admin"]), r["created"], r["revoked"])


def create(db_path: Path, name: str, tenant: str = "default", priority_class: str = "silver",
           admin: bool = False) -> tuple[ApiKey, str]:
    """Create a key; returns it and the full secret string, which is never stored and never shown again."""
    if not name.strip():
        raise KeyProblem("a key needs a name (who or what uses it)")
    if priority_class not in PRIORITY_CLASSES:
        raise KeyProblem(f"class must be one of {', '.join(PRIORITY_CLASSES)} (got {priority_class!r})")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    key = ApiKey(key_id, name.strip(), tenant.strip() or "default", priority_class, admin, time.time())
    db = open_db(db_path)
    try:
        with db.atomic():
            db.table("api_keys").insert({"id": key.id, "name": key.name, "tenant": key.tenant,
                                   "priority_class": key.priority_class, "admin": int(admin),
                                   "secret_sha256": _hash(secret), "created": key.created, "revoked": None})
    finally:
        db.close()
    return key, f"{PREFIX}_{key_id}_{secret}"


def list_keys(db_path: Path) -> list[ApiKey]:
    db = open_db(db_path)
    try:
        return [_row_to_key(r) for r in db["api_keys"].rows_where(order_by="created")]
    finally:
        db.close()


def revoke(db_path: Path, key_id: str) -> ApiKey:
    db = open_db(db_path)
    try:
        rows = list(db["api_keys"].rows_where("id = ?", [key_id]))
        if not rows:
            raise KeyProblem(f"no key with id {key_id!r} (see `appliance keys list`)")
        if rows[0]["revoked"] is None:
            with db.atomic():
                db.table("api_keys").update(key_id, {"revoked": time.time()})
        return _row_to_key(next(db["api_keys"].rows_where("id = ?", [key_id])))
    finally:
        db.close()


class KeyVerifier:
    """Checks presented keys against the key table, held whole in memory and reloaded once it is older
    than `ttl_s`.

    A site has tens of keys, so the table is small: a lookup is a dict lookup, and an id nobody issued
    (anyone can send one, no valid key needed) costs no query and no memory. The event loop never touches
    SQLite: `verify_async` reloads a stale table in a worker thread, one reload shared by every request that
    finds it stale; `verify` reloads in the caller's thread (the CLI, tests, other threads). A key created or
    revoked with `appliance keys` (another process) takes effect within ttl_s; `invalidate` makes the next
    request reload (a configuration reload does).
    """

    def __init__(self, db_path: Path, ttl_s: float = 5.0) -> None:
        self.db_path = db_path
        self.ttl_s = ttl_s
        self._keys: dict[str, tuple[ApiKey, str]] = {}  # replaced whole, never changed in place
        self._loaded_at = -math.inf
        self._lock = threading.Lock()  # one reload at a time
        self._reloading: asyncio.Future[None] | None = None
        self.reloads = 0

    def stale(self) -> bool:
        return time.monotonic() - self._loaded_at > self.ttl_s

    def invalidate(self) -> None:
        self._loaded_at = -math.inf

    def reload(self) -> None:
        """Read the whole key table (blocking: call it off the event loop)."""
        started = time.monotonic()
        with self._lock:
            db = open_db(self.db_path)  # its own connection: reloads are rare and run on any worker thread
            try:
                rows = list(db["api_keys"].rows_where()) if db["api_keys"].exists() else []
            finally:
                db.close()
            self._keys = {r["id"]: (_row_to_key(r), r["secret_sha256"]) for r in rows}
            self._loaded_at = started
            self.reloads += 1

    def verify(self, presented: str) -> ApiKey | None:
        """From any thread but the event loop's."""
        if self.stale():
            self.reload()
        return self.lookup(presented)

    async def verify_async(self, presented: str) -> ApiKey | None:
        """On the event loop: a stale table is reloaded in a worker thread, once for all who wait on it."""
        if self.stale():
            if self._reloading is None or self._reloading.done():
                self._reloading = asyncio.ensure_future(asyncio.to_thread(self.reload))
            try:
                await asyncio.shield(self._reloading)
            except sqlite3.ProgrammingError:
                raise  # a bug here, not the database's state
            except sqlite3.DatabaseError as e:  # locked, unreadable or damaged: the table held answers (retried next time)
                log.warning("could not reload the API keys (%s); using the %d held", e, len(self._keys))
        return self.lookup(presented)

    def lookup(self, presented: str) -> ApiKey | None:
        """The key a presented secret belongs to, from the table in memory (no I/O)."""
        parsed = parse(presented)
        if parsed is None:
            return None
        key_id, secret = parsed
        found = self._keys.get(key_id)
        if found is None or not found[0].active:
            return None
        key, stored = found
        # constant-time comparison of the hashes: timing reveals nothing about the secret
        return key if hmac.compare_digest(_hash(secret), stored) else None
