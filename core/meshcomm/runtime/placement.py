"""Where a process sits in a job, read from the variables of whatever started it.

meshcomm's own launcher sets ``MLX_RANK``/``MLX_WORLD_SIZE``/``MLX_LOCAL_RANK``/``MLX_LOCAL_SIZE``;
Slurm's ``srun``, Open MPI's and MPICH's ``mpirun``/``mpiexec`` and ``torchrun`` set their
own (:data:`meshcomm.runtime.launchvars.FAMILIES` names them all). :func:`placement` reads the first
family present, rank and sizes from the same family (mixing ``SLURM_PROCID`` with torchrun's
``WORLD_SIZE`` would pair numbers from two jobs).
:func:`coordinator` says where rank 0 serves the rendezvous: ``MLX_COORDINATOR``, else
``MASTER_ADDR`` and ``MASTER_PORT + 1`` (``MASTER_PORT`` itself is torch's: torchrun's agent
serves its store there), else one derived from the Slurm step.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ..protocol.errors import ConfigError
from .launchvars import FAMILIES

__all__ = [
    "Placement",
    "Coordinator",
    "placement",
    "coordinator",
    "parse_coordinator",
    "expand_hostlist",
    "host_cores",
    "crowded",
    "host_key",
    "FAMILIES",
]


def host_cores() -> int:
    """Cores of this host (not this process's affinity: a launcher may bind each rank to one)."""
    return os.cpu_count() or 1


def crowded(local_ranks: int) -> bool:
    """Whether this host runs more of the job's ranks than it has cores: a waiting rank
    that polls would then take the core the rank it waits for needs."""
    return local_ranks > host_cores()


@functools.cache
def host_key() -> int:
    """A 62-bit number equal exactly for processes that can see each other in ``/proc``: same
    host name, same boot and same PID namespace. A host name alone is not enough: containers
    with the host's network share its name but not its processes, and two machines may share
    a name; a peer's pid is looked up only where this key matches."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            parts.append(fh.read().strip())
    except OSError:
        parts.append("-")
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("-")
    digest = hashlib.sha256("\0".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


@dataclass(frozen=True)
class Placement:
    """This process's rank and the job's size (None where the starter does not say)."""

    rank: int
    size: int | None
    local_rank: int | None
    local_size: int | None
    source: str  # the family, e.g. "Slurm"; errors and `meshcomm info` show it


@dataclass(frozen=True)
class Coordinator:
    """Where rank 0 serves the rendezvous, and which variables said so."""

    host: str
    port: int
    source: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _int(environ: Mapping[str, str], name: str, *, low: int = 0) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer; unset it or give a whole number >= {low}") from None
    if value < low:
        raise ConfigError(f"{name}={value} must be >= {low}")
    return value


def _slurm_local_size(environ: Mapping[str, str]) -> int | None:
    """Tasks on this node: SLURM_STEP_TASKS_PER_NODE ("2(x3),1") at index SLURM_NODEID."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node = _int(environ, "SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[node] if node < len(counts) else None


def _in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True in a task srun started. A batch script (sbatch) also sees SLURM_PROCID=0 and
    SLURM_NTASKS, but no step id: there it is the one process that will call srun, not rank 0
    of the job (checked on Slurm 22.05)."""
    return bool(environ.get("SLURM_STEP_ID", "").strip() or environ.get("SLURM_STEPID", "").strip())


def placement(environ: Mapping[str, str] | None = None) -> Placement | None:
    """This process's place in the job, from the first family of variables present, or None
    when no starter set a rank. Raises ConfigError for a value that is not a number or a
    rank not below the size."""
    env = os.environ if environ is None else environ
    for fam in FAMILIES:
        rank = _int(env, fam.rank)
        if rank is None or (fam.name == "Slurm" and not _in_slurm_step(env)):
            continue
        size = _int(env, fam.size, low=1) if fam.size else None
        if fam.name == "PMIx" and size is None:
            size = _int(env, "OMPI_COMM_WORLD_SIZE", low=1)
        local_rank = _int(env, fam.local_rank) if fam.local_rank else None
        local_size = _int(env, fam.local_size, low=1) if fam.local_size else None
        if fam.name == "Slurm":
            local_size = _slurm_local_size(env)
        if size is not None and rank >= size:
            raise ConfigError(
                f"{fam.rank}={rank} is not below {fam.size}={size} ({fam.name} set them): ranks run from 0 "
                f"to {size - 1}; check how the job was started"
            )
        if local_rank is not None and local_size is not None and local_rank >= local_size:
            raise ConfigError(f"{fam.local_rank}={local_rank} is not below {fam.local_size}={local_size}")
        return Placement(rank, size, local_rank, local_size, fam.name)
    return None


def _split_address(text: str, name: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\s\[\]]+):(\d+)", text.strip())
    if m is None:
        raise ConfigError(f"{name}={text!r} is not host:port (e.g. node1:29500, 10.0.0.1:29500 or [fe80::1]:29500)")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 < port < 65536:
        raise ConfigError(f"{name}={text!r}: port {port} is not in 1..65535")
    return host, port


def parse_coordinator(text: str, source: str = "MLX_COORDINATOR") -> Coordinator:
    """``"host:port"`` / ``"[v6]:port"`` as a Coordinator; ConfigError naming ``source`` if malformed."""
    host, port = _split_address(text, source)
    return Coordinator(host, port, source)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list ("node[1-3,7],gpu-a[01-02]") as host names, in order."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", text):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


#: Slurm-derived coordinator ports lie in [_SLURM_PORT_BASE, _SLURM_PORT_BASE + _SLURM_PORT_SPAN)
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 10000


def coordinator(environ: Mapping[str, str] | None = None) -> Coordinator | None:
    """Where rank 0 serves the rendezvous: MLX_COORDINATOR, else MASTER_ADDR and the port
    after MASTER_PORT (MASTER_PORT is torch's: torchrun's agent store listens there), else,
    inside a Slurm step, the step's first node and a port derived from the job and step ids
    (the same on every task). None when nothing says."""
    env = os.environ if environ is None else environ
    text = env.get("MLX_COORDINATOR", "").strip()
    if text:
        host, port = _split_address(text, "MLX_COORDINATOR")
        return Coordinator(host, port, "MLX_COORDINATOR")
    addr, port_text = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if addr or port_text:
        if not (addr and port_text):
            missing = "MASTER_PORT" if addr else "MASTER_ADDR"
            raise ConfigError(
                f"MASTER_ADDR and MASTER_PORT go together but {missing} is not set; set both "
                "(or MLX_COORDINATOR=host:port)"
            )
        host, port = _split_address(f"[{addr}]:{port_text}" if ":" in addr else f"{addr}:{port_text}", "MASTER_PORT")
        # MASTER_PORT itself belongs to torch: torchrun's agent serves its TCPStore there, and a
        # program's own init_process_group() opens one there; meshcomm takes the port above it
        if port == 65535:
            return Coordinator(host, port - 1, "MASTER_ADDR/MASTER_PORT-1 (MASTER_PORT itself is torch's)")
        return Coordinator(host, port + 1, "MASTER_ADDR/MASTER_PORT+1 (MASTER_PORT itself is torch's)")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    job = _int(env, "SLURM_JOB_ID")
    if nodes and job is not None and _int(env, "SLURM_PROCID") is not None and _in_slurm_step(env):
        step = _int(env, "SLURM_STEP_ID") or _int(env, "SLURM_STEPID") or 0
        port = _SLURM_PORT_BASE + (job * 131 + step) % _SLURM_PORT_SPAN
        return Coordinator(expand_hostlist(nodes)[0], port, f"Slurm step {job}.{step}")
    return None
