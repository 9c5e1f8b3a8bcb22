"""The backhaul client: the regional OpenAI-compatible cluster over httpx.

Every call carries an `Idempotency-Key` (the escalation id), so a retry, or a resend after a crash
between the send and the commit, can be dropped as a duplicate on the regional side. That is what
makes retrying after a timeout safe; a request with no escalation id is never retried.

Outcomes are sorted by what the caller should do:

* `LinkDown`         connect failure, timeout, breaker open: the link is the problem; try later.
* `RegionalRejected` 4xx other than 408/429: the request itself is wrong; retrying will not help.
* `RegionalFailed`   5xx, 408, 429 or an answer that is not an OpenAI response: try later. A 429 or 503
                     with Retry-After (an llm-d gateway dropping work under load) holds the breaker for
                     that long and carries it, so the forwarder waits as asked.

With `RegionalSettings.gateway` set, each call also carries llm-d's scheduling headers for its class and
tenant (cascade/gateway_headers.py).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cascade.breaker import CircuitBreaker
from cascade.gateway_headers import GatewayHeaders, refusal

IDEMPOTENCY_HEADER = "Idempotency-Key"


class RegionalError(Exception):
    pass


class LinkDown(RegionalError):
    pass


class RegionalRejected(RegionalError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the regional cluster refused the request ({status}): {message}")
        self.status = status


class RegionalFailed(RegionalError):
    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # the cluster said when to come back

    @property
    def counts_as_attempt(self) -> bool:
        """A cluster that said when to come back is not failing this escalation: no attempt towards giving up."""
        return self.retry_after_s is None


class TokenFileError(ValueError):
    pass


class TLSFileError(ValueError):
    pass


@dataclass(frozen=True)
class RegionalSettings:
    base_url: str
    model: str
    token_file: Path | None = None
    ca_bundle: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 120.0
    retries: int = 1  # extra attempts within one call, only when the connection could not be made
    breaker_failures: int = 3
    breaker_reset_s: float = 10.0
    breaker_max_reset_s: float = 300.0
    gateway: GatewayHeaders | None = None  # llm-d's scheduling headers; None for a plain OpenAI endpoint


def read_token(path: Path | None) -> str | None:
    """The bearer token; refused when the file is readable by group or others (it is a credential)."""
    return None if path is None else read_secret(path, "regional.token_file")


def read_secret(path: Path, setting: str) -> str:
    """A credential from a private file (mode 0600 or stricter, not empty); `setting` names it in errors."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise TokenFileError(f"{setting} {path} has mode {mode:o}; run `chmod 600 {path}`")
        token = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise TokenFileError(f"cannot read {setting} {path}: {e.strerror}") from None
    if not token:
        raise TokenFileError(f"{setting} {path} is empty")
    return token


def tls_verify(settings: RegionalSettings) -> ssl.SSLContext | bool:
    """What httpx verifies the regional server with: its default (True) unless a CA bundle or a client
    certificate is configured, then one SSLContext holding them (httpx 0.28 deprecates a path as
    `verify` and the `cert` argument)."""
    if settings.ca_bundle is None and settings.client_cert is None:
        return True
    try:
        ctx = (ssl.create_default_context(cafile=str(settings.ca_bundle)) if settings.ca_bundle
               else httpx.create_ssl_context())
    except (OSError, ssl.SSLError) as e:
        raise TLSFileError(f"regional.ca_bundle {settings.ca_bundle} is not a readable PEM CA bundle: {e}") from None
    if settings.client_cert is not None:
        key = settings.client_key or settings.client_cert
        try:
            ctx.load_cert_chain(str(settings.client_cert), str(key))
        except (OSError, ssl.SSLError) as e:
            raise TLSFileError(f"regional.client_cert {settings.client_cert} with key {key} cannot be loaded "
                               f"(PEM certificate and its private key expected): {e}") from None
    return ctx


@dataclass(frozen=True)
class RegionalAnswer:
    status: int
    body: dict[str, Any]


class RegionalClient:
    def __init__(self, settings: RegionalSettings, breaker: CircuitBreaker | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.breaker = breaker or CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s,
                                                 settings.breaker_max_reset_s)
        token = read_token(settings.token_file)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.AsyncClient(
            base_url=settings.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s),
            verify=tls_verify(settings),
            transport=transport,
        )
        self.link_up: bool | None = None  # unknown until the first call

    async def aclose(self) -> None:
        await self.client.aclose()

    async def complete(self, route: str, body: dict[str, Any], idempotency_key: str, *,
                       priority_class: str = "silver", tenant: str | None = None) -> RegionalAnswer:
        """One non-streamed completion; raises one of the RegionalError kinds above."""
        if not self.breaker.allow():
            raise LinkDown(f"the regional link is down (circuit open; next try in {self.breaker.retry_in_s:.0f}s)")
        payload = json.dumps(body).encode()
        headers = {IDEMPOTENCY_HEADER: idempotency_key, "Content-Type": "application/json"}
        if self.settings.gateway is not None:
            headers |= self.settings.gateway.for_request(priority_class, tenant)
        attempt = 0
        while True:
            try:
                # base_url ends in /v1 like an OpenAI client's; routes are stored as the appliance serves them
                r = await self.client.post("/" + route.removeprefix("/v1/").lstrip("/"), content=payload,
                                           headers=headers)
                return self._judge(r)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # Nothing reached the other side: retrying costs little. A read timeout is not retried
                # here: the cluster may still be working on it, and the forwarder resends later anyway.
                if attempt < self.settings.retries:
                    attempt += 1
                    await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
                    continue
                self._link(False)
                raise LinkDown(f"the regional cluster cannot be reached ({type(e).__name__})") from None
            except httpx.TransportError as e:
                self._link(False)
                raise LinkDown(f"the regional link failed mid-request ({type(e).__name__})") from None

    async def models(self, timeout_s: float | None = None) -> httpx.Response:
        """GET /models with this client's token and TLS (raises httpx.HTTPError when unreachable); the
        breaker is not touched: the doctor's link check asks this."""
        return await self.client.get("/models", timeout=timeout_s or self.settings.connect_timeout_s + 2)

    async def probe(self) -> bool:
        """A cheap reachability check (GET /models) that also drives the breaker."""
        try:
            r = await self.models()
        except httpx.HTTPError:
            self._link(False)
            return False
        ok = r.status_code < 500
        self._link(ok)
        return ok

    def _link(self, up: bool) -> None:
        self.link_up = up
        if up:
            self.breaker.success()
        else:
            self.breaker.failure()

    def _judge(self, r: httpx.Response) -> RegionalAnswer:
        refused = refusal(r.status_code, r.headers, cap_s=self.settings.breaker_max_reset_s)
        if refused is not None and refused.retry_after_s is not None:
            # Overloaded, and it said for how long: nothing more goes over the link until then.
            self.link_up = True
            self.breaker.hold(refused.retry_after_s)
            raise RegionalFailed(refused.describe(), refused.retry_after_s)
        # Any HTTP answer proves the link works; whether the answer is usable is a separate question.
        self._link(True)
        if refused is not None:
            raise RegionalFailed(refused.describe())
        if r.status_code == 408 or r.status_code >= 500:  # 429 and 503 are refusals, above
            raise RegionalFailed(f"the regional cluster answered {r.status_code}: {r.text[:200]}")
        try:
            body = r.json()
        except ValueError:
            raise RegionalFailed(f"the regional cluster answered {r.status_code} with a body that is not JSON: "
                                 f"{r.text[:200]!r}") from None
        if r.status_code >= 400:
            err = body.get("error") if isinstance(body, dict) else None
            msg = err.get("message") if isinstance(err, dict) else str(body)[:200]
            raise RegionalRejected(r.status_code, str(msg))
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
            raise RegionalFailed(f"the regional cluster's answer is not an OpenAI completion: {r.text[:200]!r}")
        return RegionalAnswer(r.status_code, body)
