"""``meshcomm trace summary FILE [--plot PNG]`` and ``meshcomm trace merge DIR``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``trace`` on the ``meshcomm`` command's subparsers."""
    p = sub.add_parser(
        "trace",
        help="read the traces MESHCOMM_TRACE / meshcomm launch --trace wrote",
        description="Summarise or merge the traces of a job run with MESHCOMM_TRACE=DIR "
        "(or meshcomm launch --trace DIR). See docs/observability.md.",
    )
    tsub = p.add_subparsers(dest="trace_command", required=True)
    s = tsub.add_parser("summary", help="a table per operation and size, and the stragglers of slow operations")
    s.add_argument("file", help="the merged trace (DIR/trace.json) or the directory of rank files")
    s.add_argument("--plot", metavar="PNG", help="also draw the timeline and each rank's waiting (needs matplotlib)")
    s.add_argument("--slow", type=int, default=10, metavar="N", help="slow operations to list (default 10)")
    s.set_defaults(func=_summary)
    m = tsub.add_parser("merge", help="merge DIR/rank-R.json into one Chrome/Perfetto trace (launch --trace does it)")
    m.add_argument("dir", help="the directory MESHCOMM_TRACE named")
    m.add_argument("-o", "--out", default=None, help="output file (default DIR/trace.json)")
    m.set_defaults(func=_merge)


def _err(msg: str) -> int:
    sys.stderr.write(f"meshcomm trace: error: {msg}\n")
    return 2


def _summary(args: argparse.Namespace) -> int:
    from .chrome import load_trace
    from .summary import format_summary

    try:
        trace = load_trace(args.file)
    except ValueError as exc:
        return _err(str(exc))
    print(format_summary(trace, args.slow))
    if args.plot:
        from ..bench.plot import MissingMatplotlib
        from .plot import plot_trace

        try:
            plot_trace(trace, args.plot)
        except MissingMatplotlib as exc:
            return _err(str(exc))
        print(f"plot written to {args.plot}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .chrome import merge_dir

    try:
        path, missing = merge_dir(args.dir, args.out)
    except ValueError as exc:
        return _err(str(exc))
    print(
        f"merged trace written to {path}" + (f"; no file from ranks {', '.join(map(str, missing))}" if missing else "")
    )
    return 0
