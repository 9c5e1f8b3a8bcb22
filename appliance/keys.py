"""API keys: created once and shown once, stored hashed, revocable.

A key reads `apk_<id>_<secret>`: the id is public (it names the key in lists and logs), the secret is
32 random bytes. Only sha256(secret) is stored. The secret has 256 bits of entropy, so a fast hash is
enough (a password hash such as scrypt protects low-entropy secrets, which these are not), and the
comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import sqlite_utils

from appliance.store import open_db
from cascade.policy import PRIORITY_CLASSES

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
    """Checks presented keys against the database, caching each answer for `ttl_s`.

    The cache keeps SQLite off the per-request path; a revocation made with `appliance keys revoke`
    (another process) takes effect within ttl_s. It holds at most `max_entries` key ids, least recently
    used out first: ids nobody issued (anyone can send them, no valid key needed) cannot grow it. An
    OrderedDict rather than cachetools' TTLCache: the same few lines, and no new dependency in the
    packages for them.
    """

    def __init__(self, db_path: Path, ttl_s: float = 5.0, max_entries: int = 4096) -> None:
        self.db_path = db_path
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._cache: OrderedDict[str, tuple[float, ApiKey | None, str | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._db: sqlite_utils.Database | None = None

    def verify(self, presented: str) -> ApiKey | None:
        parsed = parse(presented)
        if parsed is None:
            return None
        key_id, secret = parsed
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key_id)
            if hit is None or now - hit[0] > self.ttl_s:
                hit = (now, *self._load(key_id))
                self._cache[key_id] = hit
                if len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key_id)
        _, key, stored = hit
        if key is None or stored is None or not key.active:
            return None
        # constant-time comparison of the hashes: timing reveals nothing about the secret
        return key if hmac.compare_digest(_hash(secret), stored) else None

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def _load(self, key_id: str) -> tuple[ApiKey | None, str | None]:
        if self._db is None:
            self._db = open_db(self.db_path)
        rows = list(self._db["api_keys"].rows_where("id = ?", [key_id]))
        if not rows:
            return None, None
        return _row_to_key(rows[0]), rows[0]["secret_sha256"]
