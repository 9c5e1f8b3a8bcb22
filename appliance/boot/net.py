"""Addresses: which hosts are loopback, and the URL a client uses to reach a listening address."""

from __future__ import annotations

import ipaddress

# A daemon listening on every address is reached on loopback from the same machine.
_ANY = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def http_url(host: str, port: int, path: str = "") -> str:
    """http://host:port/path, with an IPv6 literal in brackets (RFC 3986)."""
    host = host.strip("[]")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


def local_url(host: str, port: int, path: str = "") -> str:
    """The URL this machine reaches a server on that listens on host (a wildcard address means loopback)."""
    return http_url(_ANY.get(host, host), port, path)
