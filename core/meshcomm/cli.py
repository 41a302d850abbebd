"""The ``meshcomm`` command: ``info`` (installed backends) and the subcommands plugins add."""

from __future__ import annotations

import argparse
import importlib
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


#: each subcommand but ``info``, by the module whose ``add_parser(sub)`` adds it
_COMMANDS = {"launch": ".launch.cli", "bench": ".bench.cli", "trace": ".trace.cli"}


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; with ``command``, only that subcommand's arguments, so that
    ``meshcomm launch`` does not import what ``bench`` needs (NumPy and the API)."""
    p = argparse.ArgumentParser(prog="meshcomm", description="collective communication for NumPy arrays")
    sub = p.add_subparsers(dest="command", required=True)
    if command in (None, "info"):
        info = sub.add_parser("info", help="list installed backends, versions and why any is unavailable")
        info.add_argument("--json", action="store_true", help="print JSON instead of a table")
        info.set_defaults(func=_info)
    for name, module in _COMMANDS.items():
        if command in (None, name):
            importlib.import_module(module, __package__).add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshcomm`` console script and ``python -m meshcomm``."""
    words = list(sys.argv[1:] if argv is None else argv)
    command = words[0] if words and (words[0] in _COMMANDS or words[0] == "info") else None
    args = _parser(command).parse_args(words)
    return int(args.func(args) or 0)
