"""Building the mpiexec command of the MPI that mpi4py loads.

Used by ``meshcomm launch --backend mpi`` (through :class:`meshcomm_mpi.plugin.MPILauncher`)
and directly by tests and scripts::

    subprocess.run(mpiexec_command(4, [sys.executable, "train.py"]))

Open MPI and MPICH (Hydra) spell things differently; the flavour comes from the
library mpi4py loads (or from ``mpiexec --version`` for ``MESHCOMM_MPIEXEC``):

* Open MPI refuses to run as root without ``--allow-run-as-root``, and more ranks
  than cores without ``--oversubscribe``; environment variables go with ``-x K=V``, or
  ``-x K`` to pass mpiexec's own value of ``K`` without writing it on the command line;
* MPICH passes environment variables with ``-genv K V`` and hosts with ``-hosts``; its
  Hydra mpiexec passes its whole environment to every rank by default (``-genvall``),
  also to remote hosts (through its proxies' control connection, not a command line).

Secrets never go on the command line (every local user can read it in ``ps``): the job
secret and the launcher's user variables (``--env``, hostfile ``envs``) are set in
mpiexec's environment and named with ``forward=`` (Open MPI: ``-x NAME``; MPICH: passed
with the rest of the environment, unless ``MESHCOMM_MPIEXEC_ARGS`` has ``-genvnone`` or
``-genvlist``).

``python -m meshcomm_mpi.launcher --which`` prints the mpiexec and MPI it found.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshcomm.plugin import JobSpec, check_env_name, load_settings, secret_names

from .discover import find_library, find_mpiexec, mpiexec_flavor
from .settings import FT_ENV, MPISettings

__all__ = ["mpiexec_command", "job_command", "fault_tolerance_flags", "resolve_mpiexec", "main"]


def _local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_mpiexec(settings: MPISettings | None = None) -> tuple[Path, str]:
    """``(mpiexec path, flavour)`` for the MPI mpi4py loads (or ``MESHCOMM_MPIEXEC``).

    Raises RuntimeError saying what to install or set when there is none.
    """
    settings = settings if settings is not None else load_settings(MPISettings)
    lib = find_library()
    exe = find_mpiexec(lib, settings.mpiexec)
    flavor = lib.flavor
    if settings.mpiexec is not None:
        flavor = mpiexec_flavor(str(exe)) or flavor
        if flavor != lib.flavor:
            raise RuntimeError(
                f"MESHCOMM_MPIEXEC={settings.mpiexec} is a {flavor} mpiexec but mpi4py loads "
                f"{lib.version} ({lib.path}); ranks would each start alone. Point MESHCOMM_MPIEXEC "
                f"at the {lib.flavor} mpiexec, or MPI4PY_LIBMPI at the {flavor} library."
            )
    return exe, flavor


def mpiexec_command(
    n: int,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    hosts: Sequence[tuple[str, int]] | None = None,
    extra: Sequence[str] = (),
    settings: MPISettings | None = None,
    forward: Sequence[str] = (),
) -> list[str]:
    """The command that runs ``argv`` on ``n`` MPI ranks.

    Args:
        n: number of ranks (>= 1).
        argv: the program and its arguments, run by every rank.
        env: variables to set on every rank (forwarded to remote hosts as well), written
            with their values on the command line, where every local user can read them:
            a secret-looking name (``MESHCOMM_JOB_SECRET``, ``*TOKEN``, ``*PASSWORD``, ...)
            is refused; pass it with ``forward``.
        hosts: ``[(host, ranks on it), ...]`` for multi-host jobs; None runs locally.
        extra: further mpiexec arguments (``MESHCOMM_MPIEXEC_ARGS`` is appended too).
        settings: the mpi backend's settings (default: from the environment).
        forward: names of variables that mpiexec passes from its own environment to every
            rank without their values on any command line (Open MPI ``-x NAME``; MPICH's
            Hydra passes its whole environment anyway). The caller sets them in the
            environment mpiexec runs with.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"mpiexec_command: n={n!r} is not a positive number of ranks")
    if not argv:
        raise ValueError("mpiexec_command: argv is empty; pass the program to run, e.g. [sys.executable, 'x.py']")
    env = dict(env or {})
    hidden = secret_names(env)
    if hidden:
        raise ValueError(
            f"mpiexec_command: {', '.join(hidden)} would be on mpiexec's command line, readable by every "
            "local user (ps); set it in mpiexec's environment and pass its name in forward=[...]"
        )
    for name in [*env, *forward]:
        check_env_name(name, "mpiexec_command")
    settings = settings if settings is not None else load_settings(MPISettings)
    exe, flavor = resolve_mpiexec(settings)
    cmd = [str(exe), "-n", str(n)]
    if flavor == "openmpi":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if hosts:
            cmd += ["--host", ",".join(f"{h}:{k}" for h, k in hosts)]
        elif n > _local_cores():
            cmd.append("--oversubscribe")
        for k, v in env.items():
            cmd += ["-x", f"{k}={v}"]
        for k in forward:
            if k not in env:
                cmd += ["-x", k]  # the value comes from mpiexec's environment, not from here
    else:
        if hosts:
            cmd += ["-hosts", ",".join(f"{h}:{k}" for h, k in hosts)]
        for k, v in env.items():
            cmd += ["-genv", k, v]
        # forward: Hydra's default (-genvall) passes mpiexec's whole environment to every rank
    cmd += list(extra) + shlex.split(settings.mpiexec_args)
    return cmd + list(argv)


#: variables of the launcher's environment for ranks that may be shown on mpiexec's command
#: line (job layout, not secrets); every other one (the job secret, --env and hostfile
#: ``envs`` variables) is passed by name only
_SHOWN = (
    "MLX_BACKEND",
    "MLX_WORLD_SIZE",
    "MLX_TIMEOUT",
    "MESHCOMM_JOB_ID",
    "MESHCOMM_JOB_DIR",
    "MESHCOMM_OUTPUT_DIR",
    "PYTHONUNBUFFERED",
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
)


def fault_tolerance_flags(flavor: str) -> list[str]:
    """mpiexec's flags for a job whose survivors go on after a rank is lost (``--keep-going``):
    Open MPI's ULFM, on the TCP transport (its shared-memory one does not report failed
    peers: a job on it hangs). None for MPICH: the wheel's library has no ``MPIX_Comm_iagree``,
    and its Hydra mpiexec fails when a rank is killed even with ``-disable-auto-cleanup``."""
    if flavor == "openmpi":
        return ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]
    return []


def job_command(job: JobSpec, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``external_command`` of the launcher: the mpiexec command for a planned ``JobSpec``.

    Ranks are placed on the job's hosts in rank order (``--host a:2,b:2``); a job that
    only uses this machine runs locally. When the ranks send their output to meshcomm
    launch themselves (``MESHCOMM_OUTPUT_DIR`` in ``env``: the rank runner writes to per-rank
    FIFOs the launcher reads and prefixes), mpiexec is not asked to tag it; otherwise lines
    are tagged by mpiexec (``--tag-output`` / ``-prepend-rank``; Hydra tags every write, so
    lines may be split).

    ``env`` is also the environment the launcher runs mpiexec with: the job's layout
    variables are written on the command line, the job secret and user variables are
    forwarded by name only (see :func:`mpiexec_command`).
    """
    counts: dict[str, int] = {}
    for place in job.places:
        if place.host is not None:
            counts[place.host] = counts.get(place.host, 0) + 1
    hosts = None
    if counts and set(counts) != {"localhost"}:
        local = sum(1 for p in job.places if p.host is None)
        hosts = ([("localhost", local)] if local else []) + list(counts.items())
    exe, flavor = resolve_mpiexec()
    extra: list[str] = []
    if "MESHCOMM_OUTPUT_DIR" not in env:
        extra = ["--tag-output"] if flavor == "openmpi" else ["-prepend-rank"]
    shm_dir = getattr(job, "shm_dir", None)
    if flavor == "openmpi" and hosts is None and shm_dir is not None:
        # Open MPI's shared-memory segments and session directory inside the job's own
        # shared-memory directory, which the launcher removes even when it is killed
        # (otherwise a killed job leaves /dev/shm/sm_segment.* and /tmp/ompi.* behind)
        if Path(exe).resolve().name.startswith("prte"):  # Open MPI 5: PRRTE's prterun
            extra += ["--mca", "btl_sm_backing_directory", str(shm_dir), "--prtemca", "prte_tmpdir_base", str(shm_dir)]
        else:  # Open MPI 4: ORTE's orterun, the vader BTL
            extra += ["--mca", "btl_vader_backing_directory", str(shm_dir), "--mca", "orte_tmpdir_base", str(shm_dir)]
    shown = {k: v for k, v in env.items() if k in _SHOWN}
    forward = [k for k in env if k not in shown]
    ft = fault_tolerance_flags(flavor) if getattr(job, "keep_going", False) else []
    if ft:
        extra += ft
        shown[FT_ENV] = "1"
    return mpiexec_command(int(job.nranks), argv, shown, hosts=hosts, extra=extra, forward=forward)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m meshcomm_mpi.launcher [--which | -n N -- prog args]``."""
    import argparse
    import subprocess

    p = argparse.ArgumentParser(prog="python -m meshcomm_mpi.launcher")
    p.add_argument("--which", action="store_true", help="print the MPI library and mpiexec found")
    p.add_argument("-n", type=int, default=0, help="ranks to start")
    p.add_argument("prog", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.which or not args.prog:
        lib = find_library()
        exe, flavor = resolve_mpiexec()
        print(f"library: {lib.path}\nversion: {lib.version}\nflavor:  {flavor}\nmpiexec: {exe}")
        return 0
    prog = args.prog[1:] if args.prog[0] == "--" else args.prog
    return subprocess.call(mpiexec_command(args.n or 1, prog, {"MLX_BACKEND": "mpi"}))


if __name__ == "__main__":
    sys.exit(main())
