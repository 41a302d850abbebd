"""``meshcomm launch`` command-line arguments."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start N ranks of a program on one machine or many",
        description="Start N ranks of PROGRAM. A .py program runs with this Python.",
        usage="meshcomm launch -n N [options] [--] program [args...]",
    )
    p.add_argument("-n", "--nranks", type=int, required=True, help="number of ranks")
    p.add_argument("--backend", default="sockets", help="backend: sockets (default), mpi, gloo or a plugin's")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", help="comma-separated hosts (ssh names; also the IPs ranks use)")
    where.add_argument("--hostfile", help="JSON launcher hostfile (see README)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="environment variable for every rank (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="MLX_TIMEOUT for every rank, seconds")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--verbose", action="store_true", help="print the commands that start each rank")
    p.add_argument("--cwd", default=None, help="working directory of every rank (default: this one)")
    p.add_argument("--python", default=None, help="interpreter for .py programs (default: this one)")
    p.add_argument("--ssh", default="ssh -o BatchMode=yes", help="command used to reach remote hosts")
    p.add_argument("--port-base", type=int, default=None, help="first port for ranks on remote hosts")
    p.add_argument("program", nargs=argparse.REMAINDER, help="program and its arguments")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .hosts import parse_hosts_arg, read_launch_hostfile
    from .run import launch
    from .safety import parse_env_item

    prog = list(args.program)
    if prog and prog[0] == "--":
        prog = prog[1:]
    try:
        env = dict(parse_env_item(item, f"--env {item!r}") for item in args.env)
        hosts = None
        if args.hostfile:
            hosts = read_launch_hostfile(args.hostfile)
        elif args.hosts:
            hosts = parse_hosts_arg(args.hosts)
        backend = args.backend
        if hosts is not None and hosts.backend and backend == "sockets" and "--backend" not in sys.argv:
            backend = hosts.backend
        return launch(
            args.nranks, prog, backend=backend, hosts=hosts, env=env, timeout=args.timeout,
            prefix=not args.no_prefix, verbose=args.verbose, cwd=args.cwd, python=args.python,
            ssh=args.ssh, port_base=args.port_base,
        )
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"meshcomm launch: error: {exc}\n")
        return 2
