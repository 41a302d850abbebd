"""The sockets backend's hostfile: one ``{"ip", "port"}`` entry per rank, in rank order.

Accepted forms (JSON):

* ``[{"ip": "10.0.0.1", "port": 5000}, {"ip": "host-b", "port": "5000", "bind": "0.0.0.0"}]``
  — ``ip`` is where the other ranks reach this rank (hostname, IPv4 or IPv6),
  ``bind`` (optional) is the local address it listens on (default: ``ip``);
* MLX's ring format ``[["10.0.0.1:5000"], ["[::1]:5001"]]`` (the first address of each rank);
* ``{"hosts": [...]}`` wrapping either list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshcomm.plugin import ConfigError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["Peer", "read_hostfile", "parse_hostfile", "split_hostport"]


class Peer(BaseModel):
    """Where one rank listens and how the others reach it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ip: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    bind: str | None = None

    @field_validator("ip", "bind")
    @classmethod
    def _strip(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.strip()
        if v.startswith("[") and v.endswith("]"):
            v = v[1:-1]
        if not v:
            raise ValueError("empty address")
        return v

    @property
    def bind_host(self) -> str:
        return self.bind or self.ip

    def __str__(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{host}:{self.port}"


def split_hostport(text: str) -> tuple[str, str]:
    """``"host:port"`` / ``"[v6]:port"`` -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"{text!r} is not [ipv6]:port")
        return host, rest[1:]
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not host:port")
    return host, port


def _entry(i: int, item: Any) -> dict[str, Any]:
    if isinstance(item, list):  # MLX ring format: a list of "ip:port" per rank
        if not item:
            raise ValueError("empty address list")
        item = item[0]
    if isinstance(item, str):
        host, port = split_hostport(item)
        return {"ip": host, "port": port}
    if isinstance(item, dict):
        return item
    raise ValueError(f'expected an object like {{"ip": "127.0.0.1", "port": 5000}}, got {item!r}')


def parse_hostfile(data: Any, source: str = "hostfile") -> list[Peer]:
    """Validate parsed JSON ``data``; ConfigError names the entry that is wrong and why."""
    if isinstance(data, dict) and "hosts" in data:
        data = data["hosts"]
    if not isinstance(data, list) or not data:
        raise ConfigError(f'{source}: expected a non-empty JSON list with one {{"ip", "port"}} entry per rank')
    peers = []
    for i, item in enumerate(data):
        try:
            peers.append(Peer(**_entry(i, item)))
        except (ValidationError, ValueError, TypeError) as exc:
            msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            loc = exc.errors()[0]["loc"] if isinstance(exc, ValidationError) else ()
            field = f" field {loc[0]!r}" if loc else ""
            raise ConfigError(f"{source}: entry {i} (rank {i}){field}: {msg} (entry: {json.dumps(item)})") from None
    seen: dict[tuple[str, int], int] = {}
    for i, p in enumerate(peers):
        key = (p.ip, p.port)
        if key in seen:
            raise ConfigError(f"{source}: ranks {seen[key]} and {i} both use {p}; give each rank its own port")
        seen[key] = i
    return peers


def read_hostfile(path: Path | str) -> list[Peer]:
    """Read and validate the hostfile at ``path`` (the value of MLX_HOSTFILE)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"MLX_HOSTFILE={str(p)!r} cannot be read: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"MLX_HOSTFILE={str(p)!r} is not valid JSON: {exc}") from None
    return parse_hostfile(data, f"MLX_HOSTFILE={str(p)!r}")
