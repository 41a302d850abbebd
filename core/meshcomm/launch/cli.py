"""``meshcomm launch`` command-line arguments: argparse -> :class:`LaunchOptions` -> ``launch``."""

from __future__ import annotations

import argparse
import sys

from ..protocol.errors import ConfigError
from .options import DEFAULT_BACKEND, DEFAULT_SSH, LaunchOptions

__all__ = ["add_parser", "options_from_args"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    from .starters import LAUNCHERS

    p = sub.add_parser(
        "launch",
        help="start N ranks of a program on one machine or many",
        description="Start N ranks of PROGRAM. A .py program runs with this Python.",
        usage="meshcomm launch [-n N] [options] [--] program [args...]",
    )
    p.add_argument(
        "-n",
        "--nranks",
        type=int,
        default=None,
        help="total number of ranks (default: the hosts' counts, --hosts a:2,b:2 or --ranks-per-host)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help=f"backend: {DEFAULT_BACKEND} (default, unless the hostfile names one), mpi, gloo or a plugin's",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--hosts",
        help="comma-separated hosts (ssh names; also the IPs ranks use), "
        "each optionally with its number of ranks: a:2,b:2",
    )
    where.add_argument("--hostfile", help="JSON launcher hostfile (see docs/launch.md)")
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=None,
        metavar="N",
        help="ranks on every host that does not give its own number",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="how ranks are started: auto (slurm inside a Slurm allocation, else ssh), local, ssh, slurm",
    )
    p.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="environment variable for every rank (repeatable)"
    )
    p.add_argument("--timeout", type=float, default=None, help="MLX_TIMEOUT for every rank, seconds")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="also write each rank's output to DIR/rank-R.log")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="record every rank's operations (MESHCOMM_TRACE) and merge them into DIR/trace.json "
        "at the end, for Perfetto or 'meshcomm trace summary'",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="a rank that fails or is killed does not end the job: the others may go on in a smaller world "
        "(Group.shrink); exit 0 when some rank exits 0",
    )
    p.add_argument(
        "--restart-lost",
        type=int,
        default=0,
        metavar="N",
        help="start up to N replacements for ranks that fail (implies --keep-going); each joins the job when "
        "the others call Group.grow()",
    )
    p.add_argument("--verbose", action="store_true", help="print the commands that start each rank")
    p.add_argument("--cwd", default=None, help="working directory of every rank (default: this one)")
    p.add_argument("--python", default=None, help="interpreter for .py programs (default: this one)")
    p.add_argument("--ssh", default=DEFAULT_SSH, help="command used to reach remote hosts")
    p.add_argument("--port-base", type=int, default=None, help="first port for ranks on remote hosts")
    p.add_argument("program", nargs=argparse.REMAINDER, help="program and its arguments")
    p.set_defaults(func=_run)


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The parsed command line as one :class:`LaunchOptions` (hostfile read, ``--env`` checked)."""
    from ..runtime.launchsafety import parse_env_item
    from .hosts import parse_hosts_arg, read_launch_hostfile

    prog = list(args.program)
    if prog and prog[0] == "--":
        prog = prog[1:]
    env = dict(parse_env_item(item, f"--env {item!r}") for item in args.env)
    hosts = None
    if args.hostfile:
        hosts = read_launch_hostfile(args.hostfile)
    elif args.hosts:
        hosts = parse_hosts_arg(args.hosts)
    if args.restart_lost < 0:
        raise ConfigError(f"--restart-lost {args.restart_lost}: must be 0 or more")
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        raise ConfigError(f"--ranks-per-host {args.ranks_per_host}: must be at least 1")
    return LaunchOptions(
        program=prog,
        nranks=args.nranks,
        backend=args.backend,
        hosts=hosts,
        ranks_per_host=args.ranks_per_host,
        launcher=args.launcher,
        env=env,
        timeout=args.timeout,
        prefix=not args.no_prefix,
        verbose=args.verbose,
        cwd=args.cwd,
        python=args.python,
        ssh=args.ssh,
        port_base=args.port_base,
        log_dir=args.log_dir,
        trace=args.trace,
        keep_going=args.keep_going,
        restart_lost=args.restart_lost,
    )


def _run(args: argparse.Namespace) -> int:
    from .run import launch

    try:
        return launch(options_from_args(args))
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"meshcomm launch: error: {exc}\n")
        return 2
