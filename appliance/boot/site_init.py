"""`appliance init`: a site configuration from a few answers, written with secure permissions.

The packaged configuration (appliance/packaged.toml, installed as /etc/appliance/appliance.toml) is the
template; the answers replace the keys they
name, the result is validated exactly as the daemon will read it, and only then written: mode 0640,
group `appliance` when that group exists (the service reads it; others do not). A regional token given on
standard input is written to its own file, mode 0600, owned by the service user.
"""

from __future__ import annotations

import grp
import os
import pwd
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from appliance.boot.config import ConfigError, parse

TEMPLATE = Path(__file__).resolve().parent.parent / "packaged.toml"
SERVICE_USER = "appliance"


@dataclass(frozen=True)
class Answers:
    site_name: str
    model_path: Path
    host: str = "0.0.0.0"
    port: int = 8000
    regional_url: str = ""
    regional_model: str = ""
    token_file: Path | None = None
    escalate: str = "never"
    engine_python: str | None = None
    state_dir: Path | None = None
    kernel_lock: Path | None = None


def template() -> dict[str, Any]:
    return tomllib.loads(TEMPLATE.read_text())


def render(a: Answers) -> str:
    cfg = template()
    cfg["site"] = {"name": a.site_name}
    cfg.setdefault("model", {})["path"] = str(a.model_path)
    cfg.setdefault("server", {}).update(host=a.host, port=a.port)
    if a.state_dir is not None:
        cfg.setdefault("state", {})["directory"] = str(a.state_dir)
    if a.engine_python is not None:
        if a.engine_python:
            cfg.setdefault("engine", {})["python"] = a.engine_python
        else:
            cfg.get("engine", {}).pop("python", None)
    if a.kernel_lock is not None:
        cfg.setdefault("kernels", {})["lock"] = str(a.kernel_lock)
    if a.regional_url:
        regional: dict[str, Any] = {"enabled": True, "base_url": a.regional_url, "model": a.regional_model}
        if a.token_file is not None:
            regional["token_file"] = str(a.token_file)
        cfg["regional"] = regional
        cfg["policy"] = {"escalate": a.escalate, "mode": "async"}
    order = ["site", "model", "server", "state", "engine", "kernels", "auth", "regional", "policy"]
    ordered = {k: cfg[k] for k in order if k in cfg} | {k: v for k, v in cfg.items() if k not in order}
    text = "# Written by `appliance init`; every key: /usr/share/doc/edge-appliance/configuration.md (docs/configuration.md)\n\n" + tomli_w.dumps(ordered)
    try:
        parse(text, source="the new configuration", base=Path("/"))
    except ConfigError as e:
        raise ConfigError(f"the answers do not make a valid configuration: {e}") from None
    return text


def _service_ids() -> tuple[int, int] | None:
    try:
        return pwd.getpwnam(SERVICE_USER).pw_uid, grp.getgrnam(SERVICE_USER).gr_gid
    except KeyError:
        return None


def write_private(path: Path, text: str, mode: int, owner_is_service: bool) -> None:
    """Create the file with its final mode from the start (no window where it is world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, mode)
        ids = _service_ids() if os.geteuid() == 0 else None
        if ids is not None:
            os.fchown(fd, ids[0] if owner_is_service else 0, ids[1])
    finally:
        os.close(fd)
    os.replace(tmp, path)
