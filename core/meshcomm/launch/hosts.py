"""Which hosts a job runs on and which ranks go where.

The launcher hostfile (``--hostfile``) is JSON, like MLX's::

    [{"ssh": "node1", "ips": ["10.0.0.1"], "slots": 2}, {"ssh": "node2"}]

or ``{"backend": "sockets", "envs": ["K=V"], "hosts": [...]}``; a host name alone stands
for ``{"ssh": name}``. ``ssh`` is where to start ranks (``local`` or ``localhost`` = this machine),
``ips`` the addresses other ranks use to reach it (default: the ssh name), ``slots``
how many ranks it takes (default: ranks are spread evenly in blocks), ``envs`` variables
for every rank (``KEY=VALUE``, KEY a shell identifier, like ``--env``).

Host names and ``envs`` keys reach ssh's argv and the remote start script, so they are
checked here (:mod:`meshcomm.runtime.launchsafety`): a name starting with ``-`` (an ssh option such
as ``-oProxyCommand=...``) or holding shell characters, and a key that is not a shell
identifier, are refused with a ConfigError before anything runs.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..protocol.errors import ConfigError
from ..runtime.launchsafety import check_host, parse_env_item
from ..runtime.launchspec import RankPlace

__all__ = ["Host", "LaunchHostfile", "read_launch_hostfile", "parse_hosts_arg", "place_ranks", "job_size", "is_local"]

_LOCAL_NAMES = {"local", "localhost", "127.0.0.1", "::1"}


class Host(BaseModel):
    """One machine of the job."""

    model_config = ConfigDict(extra="forbid")

    ssh: str = Field(min_length=1)
    ips: list[str] = Field(default_factory=list)
    slots: int | None = Field(default=None, ge=1)

    @field_validator("ssh")
    @classmethod
    def _destination(cls, v: str) -> str:
        v = v.strip()
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"ssh destination {v!r} must be one word (user@host or host)")
        try:
            return check_host(v, "ssh destination")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("ips")
    @classmethod
    def _addresses(cls, v: list[str]) -> list[str]:
        for ip in v:
            try:
                check_host(ip, "address")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            if "@" in ip:
                raise ValueError(f"address {ip!r} must be a host name or IP address, without user@")
        return v

    @property
    def ip(self) -> str:
        if self.ips:
            return self.ips[0]
        return "127.0.0.1" if is_local(self.ssh) else self.ssh.rpartition("@")[2]


class LaunchHostfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hosts: list[Host] = Field(min_length=1)
    backend: str | None = None
    envs: list[str] = Field(default_factory=list)

    @field_validator("envs")
    @classmethod
    def _env_items(cls, v: list[str]) -> list[str]:
        for item in v:
            try:
                parse_env_item(item, f"envs entry {item!r}")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return v

    def env(self) -> dict[str, str]:
        """``envs`` as a mapping (checked when the file was read)."""
        return dict(parse_env_item(item, "envs") for item in self.envs)


def is_local(host: str | None) -> bool:
    """True for this machine (no ssh needed)."""
    if host is None:
        return True
    name = host.rpartition("@")[2]
    return name in _LOCAL_NAMES or name == socket.gethostname()


def _validate(data: Any, source: str) -> LaunchHostfile:
    if isinstance(data, list):
        data = {"hosts": data}
    if isinstance(data, dict) and isinstance(data.get("hosts"), list):  # a name stands for {"ssh": name}
        data = {**data, "hosts": [{"ssh": h} if isinstance(h, str) else h for h in data["hosts"]]}
    try:
        return LaunchHostfile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        where = "the file"
        if len(loc) >= 2 and loc[0] == "hosts" and isinstance(loc[1], int):
            entry = data["hosts"][loc[1]] if isinstance(data, dict) else None
            field = f", field {loc[2]!r}" if len(loc) > 2 else ""
            where = f"host entry {loc[1]}{field} ({json.dumps(entry)})"
        elif loc:
            where = f"field {loc[0]!r}"
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"{source}: {where}: {msg}") from None


def read_launch_hostfile(path: str | Path) -> LaunchHostfile:
    """Read and validate a launcher hostfile; ConfigError names the bad entry."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ConfigError(f"--hostfile {str(p)!r} cannot be read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--hostfile {str(p)!r} is not valid JSON: {exc}") from None
    return _validate(data, f"--hostfile {str(p)!r}")


def _split_count(item: str) -> tuple[str, int | None]:
    """``name:K`` -> (name, K); a name alone -> (name, None). An IPv6 address takes a count
    only in brackets (``[fe80::1]:2``): a bare one's last group is part of the address."""
    name, sep, count = item.rpartition(":")
    if not sep or not count.isdigit() or (":" in name and not name.endswith("]")):
        return item, None
    if int(count) < 1:
        raise ConfigError(f"--hosts {item!r}: the number of ranks after ':' must be at least 1")
    return name, int(count)


def parse_hosts_arg(text: str) -> LaunchHostfile:
    """``--hosts a,b,c`` -> one host entry each (the name is both ssh destination and IP);
    ``--hosts a:2,b:4`` also gives each host's number of ranks (its ``slots``)."""
    items = [h.strip() for h in text.split(",") if h.strip()]
    if not items:
        raise ConfigError("--hosts is empty; give a comma-separated list like --hosts node1,node2 or node1:2,node2:2")
    entries: list[dict[str, Any]] = []
    for item in items:
        name, count = _split_count(item)
        entry: dict[str, Any] = {"ssh": name}
        if count is not None:
            entry["slots"] = count
        entries.append(entry)
    return _validate(entries, "--hosts")


def job_size(n: int | None, hosts: list[Host], ranks_per_host: int | None = None) -> int:
    """The number of ranks: ``n``, or (without ``-n``) the sum of the hosts' slots, where
    ``ranks_per_host`` is the slots of every host that gives none."""
    if n is not None:
        return n
    counts = [h.slots or ranks_per_host for h in hosts]
    if any(c is None for c in counts):
        raise ConfigError(
            "-n is missing: give the number of ranks (-n N), or a number per host "
            "(--hosts a:2,b:2, hostfile 'slots', or --ranks-per-host N)"
        )
    return sum(int(c or 0) for c in counts)


def place_ranks(
    n: int, hosts: list[Host], ranks_per_host: int | None = None, *, local_ranks: bool = True
) -> list[RankPlace]:
    """Assign ranks 0..n-1 to hosts in blocks (host 0 gets the first ranks).

    A host takes its ``slots`` ranks, else ``ranks_per_host``; when some host has neither,
    ranks are spread evenly. With ``local_ranks`` False (a starter that runs even this
    machine's ranks itself) no place is marked as this machine (``host=None``).
    """
    if n < 1:
        raise ConfigError(f"-n {n}: the number of ranks must be at least 1")
    if ranks_per_host is not None and ranks_per_host < 1:
        raise ConfigError(f"--ranks-per-host {ranks_per_host}: must be at least 1")
    given = [h.slots or ranks_per_host for h in hosts]
    if all(given):
        counts = [int(c or 0) for c in given]
        if sum(counts) < n:
            raise ConfigError(f"-n {n} ranks but the hosts have only {sum(counts)} slots in total")
    else:
        per = math.ceil(n / len(hosts))
        counts = [int(c or per) for c in given]
    places: list[RankPlace] = []
    on_host: dict[str | None, int] = {}  # a host named twice continues its local numbering
    for h, count in zip(hosts, counts, strict=True):
        for _ in range(count):
            if len(places) == n:
                break
            host = None if local_ranks and is_local(h.ssh) else h.ssh
            places.append(RankPlace(len(places), host, h.ip, on_host.get(host, 0)))
            on_host[host] = on_host.get(host, 0) + 1
    if len(places) < n:
        raise ConfigError(f"-n {n} ranks do not fit on {len(hosts)} hosts with slots {counts}")
    return places
