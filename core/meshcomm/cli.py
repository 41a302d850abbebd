"""The ``meshcomm`` command: ``info`` (installed backends) and the subcommands plugins add."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    import numpy

    from . import __version__
    from .runtime.registry import get_registry

    infos = get_registry().info()
    if args.json:
        print(json.dumps([vars(i) | {} for i in infos], indent=2))
        return 0
    print(f"meshcomm {__version__} (numpy {numpy.__version__}, python {sys.version.split()[0]}; {_call_path()})")
    print(f"{'backend':<10} {'distribution':<18} {'version':<9} {'available':<9} {'configured':<10} note")
    for i in infos:
        note = i.reason if not i.available else i.description
        print(
            f"{i.name:<10} {i.distribution or '-':<18} {i.version or '-':<9} "
            f"{'yes' if i.available else 'no':<9} {'yes' if i.configured else 'no':<10} {note}"
        )
    return 0


def _call_path() -> str:
    """Which call path a world started here runs: the compiled one (installed and not turned
    off by MESHCOMM_COMPILED) or the pure-Python one, and why."""
    from .api.guard import compiled_guard
    from .runtime.config import Config

    if compiled_guard() is None:
        return "pure-Python call path: this installation has no compiled one"
    try:
        on = Config.load().compiled
    except Exception:  # an unrelated setting is wrong: init() names it; here the default applies
        on = True
    return "compiled call path" if on else "pure-Python call path (MESHCOMM_COMPILED=0)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshcomm", description="collective communication for NumPy arrays")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="list installed backends, versions and why any is unavailable")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(func=_info)
    from .launch.cli import add_parser as add_launch

    add_launch(sub)
    from .bench.cli import add_parser as add_bench

    add_bench(sub)
    from .trace.cli import add_parser as add_trace

    add_trace(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshcomm`` console script and ``python -m meshcomm``."""
    args = _parser().parse_args(argv)
    return int(args.func(args) or 0)
