"""The slurm starter: inside a Slurm allocation, ranks are started with ``srun``, one step per node.

``meshcomm launch`` inside ``salloc``/``sbatch`` (``--launcher auto`` picks this starter
when ``SLURM_JOB_ID`` is set, or ``--launcher slurm``) uses the allocation's nodes
(``SLURM_JOB_NODELIST``) unless ``--hosts`` names some, and starts each node's ranks
through ONE ``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap bash -s`` job step: the
same start script and host agent as the ssh starter (:mod:`.ssh`, :mod:`.agent`) travel over
srun's stdin, so the job secret and the user's variables never appear on a command line,
output lines come back tagged with their rank, and ``signal``/``finish`` commands reach the
agent without another srun. Even the ranks of the node the launcher runs on are started
through srun (``local_ranks = False``), so every rank is inside the allocation's
accounting and limits.

When ``-n`` is given the ranks are spread evenly over the nodes; without it each node gets
as many ranks as the allocation has tasks there (``SLURM_TASKS_PER_NODE``).

The agent's step carries Slurm's task variables (``SLURM_PROCID=0``, ``SLURM_NTASKS=1``,
a PMIx rank under ``--mpi=pmix``); they describe the one-task step, not the meshcomm job,
so they are removed before the agent starts (the ranks get ``MLX_RANK`` & co. from the
launcher). ``SLURM_JOB_ID`` and the node list stay.

If the launcher dies, srun dies with it (a parent-death signal); the step's stdin ends and
the agent stops the node's ranks, as it does when an ssh connection ends.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ...protocol.errors import ConfigError
from ...runtime.placement import expand_hostlist
from ..hosts import Host
from . import HostStart, Output, Session, start_all
from .ssh import SshSession

__all__ = ["SlurmStarter", "create", "srun_argv", "allocation_hosts", "STEP_VARIABLES"]

#: variables of the agent's one-task step that must not reach the ranks (they would say
#: rank 0 of 1, or make a rank look like a task of an MPI step)
STEP_VARIABLES = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_GTIDS",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASK_PID",
    "SLURM_CPU_BIND",
    "SLURM_CPU_BIND_LIST",
    "SLURM_CPU_BIND_TYPE",
    "SLURM_CPU_BIND_VERBOSE",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_SRUN_COMM_HOST",
    "SLURM_SRUN_COMM_PORT",
    "SLURM_STEP_LAUNCHER_PORT",
    "SLURM_UMASK",
    "SLURM_PRIO_PROCESS",
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "PMIX_SERVER_URI",
    "PMIX_SERVER_URI2",
    "PMIX_SERVER_URI3",
    "PMIX_SERVER_URI4",
    "PMIX_SERVER_URI21",
    "PMIX_SERVER_URI41",
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_FD",
    "PMI_JOBID",
)


def _counts(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` ("2(x3),1") as one count per node."""
    counts: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        num, _, rep = part.partition("(x")
        try:
            counts.extend([int(num)] * (int(rep.rstrip(")")) if rep else 1))
        except ValueError:
            return []
    return counts


def allocation_hosts(nranks: int | None, environ: Mapping[str, str] | None = None) -> list[Host]:
    """The allocation's nodes as hosts: with ``nranks`` given, no slots (ranks spread evenly);
    without, the allocation's task count on each node as its slots."""
    env = os.environ if environ is None else environ
    text = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = expand_hostlist(text) if text.strip() else []
    if not nodes:
        raise ConfigError(
            "--launcher slurm: SLURM_JOB_NODELIST is not set; run meshcomm launch inside an "
            "allocation (salloc -N 2 meshcomm launch ..., or in an sbatch script), or name the "
            "nodes with --hosts"
        )
    counts = _counts(env.get("SLURM_TASKS_PER_NODE", "")) if nranks is None else []
    if len(counts) != len(nodes):
        counts = [0] * len(nodes)
    # the address is the node's name also for the node the launcher runs on (an sbatch
    # script runs on the allocation's first node): 127.0.0.1 would not reach it from the others
    return [Host(ssh=n, ips=[n], slots=c or None) for n, c in zip(nodes, counts, strict=True)]


def srun_argv(srun: str, node: str, extra: Sequence[str] = ()) -> list[str]:
    """The srun command that runs the host agent's start script (read from stdin) on ``node``."""
    unset = [a for v in STEP_VARIABLES for a in ("-u", v)]
    return [
        srun,
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--overlap",
        "--mpi=none",
        "--quiet",
        "--job-name=meshcomm-launch",
        *extra,
        "env",
        *unset,
        "bash",
        "-s",
    ]


class SlurmStarter:
    """``--launcher slurm``: every rank through srun, one job step per node."""

    name = "slurm"
    local_ranks = False

    def __init__(self, srun: str, extra: Sequence[str] = ()) -> None:
        self.srun = srun
        self.extra = list(extra)

    def default_hosts(self, n: int | None) -> list[Host]:
        return allocation_hosts(n)

    def start(self, hosts: Sequence[HostStart], output: Output) -> list[Session]:
        # SshSession runs [*ssh, HOST, "bash -s"]: this module's wrapper turns that into srun
        wrapper = [sys.executable, "-m", __name__, self.srun, *self.extra, "--"]

        def open_session(h: HostStart) -> Session:
            # no rank is planned on "this machine" (local_ranks = False); a host given as
            # localhost by --hosts is still reached through srun, as this node's name
            node = h.host if h.host is not None else os.environ.get("SLURMD_NODENAME", "localhost")
            try:
                return SshSession(_with_host(h, node), output, wrapper)
            except OSError as exc:
                raise OSError(f"cannot run {self.srun} for node {node}: {exc}") from None

        return start_all(hosts, open_session)


def _with_host(h: HostStart, node: str) -> HostStart:
    if h.host == node:
        return h
    from dataclasses import replace

    return replace(h, host=node)


def create(options: Any) -> SlurmStarter:
    if not os.environ.get("SLURM_JOB_ID"):
        raise ConfigError(
            "--launcher slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); run "
            "meshcomm launch inside salloc or an sbatch script, or use --launcher ssh"
        )
    srun = os.environ.get("MESHCOMM_SRUN") or shutil.which("srun")
    if not srun:
        raise ConfigError("--launcher slurm: srun is not on PATH (set MESHCOMM_SRUN to its path)")
    return SlurmStarter(srun)


def _wrapper(argv: list[str]) -> None:
    """``python -m meshcomm.launch.starters.slurm SRUN [EXTRA...] -- NODE "bash -s"``: exec srun
    for NODE (the ssh session's calling convention: destination, then the remote command)."""
    sep = argv.index("--")
    srun, extra = argv[0], argv[1:sep]
    node, command = argv[sep + 1], argv[sep + 2]
    if command != "bash -s":
        raise SystemExit(f"meshcomm slurm starter: unexpected command {command!r}")
    cmd = srun_argv(srun, node, extra)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    _wrapper(sys.argv[1:])
