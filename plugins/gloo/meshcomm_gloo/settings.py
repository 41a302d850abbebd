"""The gloo backend's settings section: where the rendezvous store is, how big the job is, the secret.

Every field is built with :func:`meshcomm.runtime.config.setting`, so it names its environment
variable and what it accepts; a bad value raises a ConfigError naming the variable.
Rank, world size and the coordinator come from the core's Config (``MLX_RANK``,
``MLX_WORLD_SIZE``, ``MLX_COORDINATOR`` or any launcher's variables); :mod:`.placing`
combines them with these settings.
"""

from __future__ import annotations

from pathlib import Path

from meshcomm.plugin import JobSecretSettings, setting

__all__ = ["GlooSettings"]


class GlooSettings(JobSecretSettings):
    """Rendezvous of the gloo backend: a TCPStore hosted by rank 0, or a shared file; the job
    secret (``secret``, ``require_secret``) tags every value in the store."""

    addr: str = setting(
        "127.0.0.1",
        env="MESHCOMM_GLOO_ADDR",
        accepts="a host name or IP address that every rank can reach (rank 0's machine)",
        description="address of the TCPStore that rank 0 hosts for the rendezvous",
        min_length=1,
    )
    port: int | None = setting(
        None,
        env="MESHCOMM_GLOO_PORT",
        accepts="a TCP port number 1-65535 that is free on rank 0's machine",
        description="port of the rendezvous TCPStore (rank 0 listens on it)",
        ge=1,
        le=65535,
    )
    file: Path | None = setting(
        None,
        env="MESHCOMM_GLOO_FILE",
        accepts="the path of a file on a file system every rank shares (it must not hold an old job's data)",
        description="rendezvous through a FileStore instead of a TCPStore (used when no port is set)",
    )
    ifname: str | None = setting(
        None,
        env="MESHCOMM_GLOO_IFNAME",
        accepts="a network interface name such as eth0 or lo (GLOO_SOCKET_IFNAME is honoured too)",
        description="network interface gloo's data connections use (default: MESHCOMM_GLOO_HOST, else the host "
        "name's address)",
    )
    host: str | None = setting(
        None,
        env="MESHCOMM_GLOO_HOST",
        accepts="an IP address of this host",
        description="the address gloo's data connections use when no interface is named (meshcomm launch and "
        "meshcomm.ray set each rank's own: a host name that resolves to a loopback address breaks jobs across "
        "hosts)",
    )
    spin_us: float = setting(
        50.0,
        env="MESHCOMM_GLOO_SPIN_US",
        tuning=True,
        accepts="a number of microseconds from 0 to 10000000",
        description=(
            "how long a rank waiting on its group's call-check channel (the call check, small "
            "all-reduces) polls before it sleeps; not used where a host runs more ranks than it "
            "has cores (longer: lower latency, more CPU burnt by waiting ranks)"
        ),
        ge=0,
        le=10_000_000,
        allow_inf_nan=False,
    )
