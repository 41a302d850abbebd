"""``meshcomm bench``: the subcommand's arguments and what it does on each rank.

Start it on every rank of a job::

    meshcomm launch -n 2 --backend sockets -- -m meshcomm bench --op all_sum --sizes 8B:64MiB

Rank 0 prints progress on stderr, the table on stdout and writes ``--json``/``--plot``.
The exit status is 1 on every rank if any result was wrong (the table marks those sizes
and gives them no figures), 2 for bad arguments.

nccl-tests' flags work too: ``-b/--minbytes``, ``-e/--maxbytes``, ``-f/--stepfactor``
(a sweep, instead of ``--sizes``), ``-n/--iters``, ``-w/--warmup_iters``.

``meshcomm bench --compare`` is not started under ``meshcomm launch``: it runs one job per
installed backend and raw peer (mpi4py, torch gloo, MLX) itself and prints the side-by-side
table (:mod:`.compare`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

import numpy as np

from .collectives import OPS
from .compare_options import COMPARE_SIZES, add_compare_arguments

__all__ = ["add_parser", "add_compare_arguments", "parse_ops", "parse_dtype", "sweep_text", "COMPARE_SIZES"]


def parse_ops(text: str) -> list[str]:
    """``"all"`` or a comma list of operation names, in the given order."""
    if text.strip() == "all":
        return list(OPS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in OPS]
    if unknown or not names:
        raise ValueError(
            f"--op {text!r}: unknown operation {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(OPS)} or all (comma-separate several)"
        )
    return names


def parse_dtype(text: str) -> np.dtype:
    """A dtype meshcomm supports (``float32``, ``int8``, ``bfloat16`` with ml_dtypes, …)."""
    from ..protocol.dtypes import check_dtype

    try:
        if text == "bfloat16":
            import ml_dtypes

            dt = np.dtype(ml_dtypes.bfloat16)
        else:
            dt = np.dtype(text)
    except (TypeError, ImportError) as exc:
        raise ValueError(f"--dtype {text!r}: {exc}") from None
    check_dtype(dt, what="--dtype")
    return dt


def sweep_text(args: argparse.Namespace) -> str:
    """The ``--sizes`` text of these arguments: ``--sizes`` itself, or nccl-tests'
    ``-b/-e/-f`` as ``MIN:MAX:FACTOR`` (unset ones default to 8B, 64MiB and 2)."""
    nccl = [args.minbytes, args.maxbytes, args.stepfactor]
    if all(v is None for v in nccl):
        return str(args.sizes or _DEFAULT_SIZES)
    if args.sizes is not None:
        raise ValueError(
            "give either --sizes or -b/-e/-f (nccl-tests' --minbytes/--maxbytes/--stepfactor), "
            f"not both (got --sizes {args.sizes!r})"
        )
    low, high, factor = (v if v is not None else d for v, d in zip(nccl, ("8B", "64MiB", "2"), strict=True))
    return f"{low}:{high}:{factor}"


_DEFAULT_SIZES = "8B:64MiB"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` on the ``meshcomm`` command's subparsers."""
    p = sub.add_parser(
        "bench",
        help="time collectives on every rank of a job (run it under meshcomm launch)",
        description="Time meshcomm's collectives across message sizes, nccl-tests style: "
        "barrier-aligned iterations, the slowest rank per iteration, median and "
        "p10/p90, algorithm and bus bandwidth, every result checked. Run it under "
        "'meshcomm launch -n N --backend B -- -m meshcomm bench ...'.",
    )
    p.add_argument(
        "--op", default="all_sum", help=f"operation(s), comma-separated, or all: {', '.join(OPS)} (default all_sum)"
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="LOW:HIGH[:FACTOR] sweep (x2 by default, HIGH always included) or sizes, "
        "comma-separated; units B, KiB, MiB, GiB (default 8B:64MiB)",
    )
    p.add_argument(
        "-b",
        "--minbytes",
        default=None,
        metavar="SIZE",
        help="nccl-tests style: smallest size of the sweep (default 8B)",
    )
    p.add_argument(
        "-e",
        "--maxbytes",
        default=None,
        metavar="SIZE",
        help="nccl-tests style: largest size of the sweep (default 64MiB)",
    )
    p.add_argument(
        "-f",
        "--stepfactor",
        default=None,
        metavar="F",
        help="nccl-tests style: multiply the size by F between steps (default 2)",
    )
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=None,
        help="timed iterations per size (default: adapt so each size takes about --min-time)",
    )
    p.add_argument(
        "-w",
        "--warmup",
        "--warmup_iters",
        dest="warmup",
        type=int,
        default=3,
        help="untimed calls per size first (default 3)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        default=0.3,
        help="seconds of timed calls per size when --iters is not given (default 0.3)",
    )
    p.add_argument("--json", metavar="FILE", help="write every row and the environment as JSON (rank 0)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of time and busbw vs size (needs matplotlib)")
    cmp = p.add_argument_group(
        "comparison",
        "--compare: float32 all_sum on every installed backend and raw peer (mpi4py, torch gloo, "
        "MLX), one job each, side by side (run it directly, not under meshcomm launch; --sizes defaults to "
        "8B:64MiB:4, and --min-time applies)",
    )
    cmp.add_argument("--compare", action="store_true", help="run the comparison instead of one job's sweep")
    add_compare_arguments(cmp)
    p.set_defaults(func=_run)


def _err(msg: str) -> None:
    sys.stderr.write(f"meshcomm bench: error: {msg}\n")


def _run(args: argparse.Namespace) -> int:
    from .sizes import parse_sizes

    try:
        sweep = sweep_text(args)
        sizes = parse_sizes(sweep)
        if args.min_time <= 0:
            raise ValueError(f"--min-time must be positive, got {args.min_time}")
        if args.compare:
            _compare_args(args, sweep)
        ops = parse_ops(args.op)
        dtype = parse_dtype(args.dtype)
        if args.iters is not None and args.iters < 1:
            raise ValueError(f"--iters must be at least 1, got {args.iters}")
        if args.warmup < 0:
            raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            from .plot import pyplot

            pyplot()  # raises MissingMatplotlib with the install hint
    except (ValueError, RuntimeError) as exc:
        _err(str(exc))
        return 2
    if args.compare:
        from .compare import run  # here, not at the top: building the parser needs no comparison

        return run(args)
    return _bench(args, ops, sizes, dtype)


def _compare_args(args: argparse.Namespace, sweep: str) -> None:
    """Check ``--compare``'s arguments and set ``args.sizes`` to its sweep (all_sum, float32 only)."""
    if args.op.strip() != "all_sum" or args.dtype != "float32" or args.iters is not None:
        raise ValueError(
            "--compare times float32 all_sum with adaptive iterations against the raw peers; "
            "drop --op, --dtype and --iters/-n (or run meshcomm bench without --compare)"
        )
    if args.json or args.plot:
        raise ValueError("--compare writes compare.json/.md/.png into --out-dir; drop --json and --plot")
    if any(n < 1 for n in args.ranks) or args.rounds < 1:
        raise ValueError(f"--ranks and --rounds must be at least 1, got {args.ranks} and {args.rounds}")
    if args.sizes is None and args.minbytes is None and args.maxbytes is None and args.stepfactor is None:
        sweep = COMPARE_SIZES
    args.sizes = sweep


def _bench(args: argparse.Namespace, ops: list[str], sizes: list[int], dtype: np.dtype) -> int:
    import meshcomm as mc

    from .report import format_table, progress_line, to_json, write_json
    from .runner import run_sweep

    g = mc.init()
    rank, n = g.rank(), g.size()
    lead = rank == 0

    def note(msg: str) -> None:
        if lead:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    if n == 1:
        note("meshcomm bench: running on 1 rank (start it under 'meshcomm launch -n N -- -m meshcomm bench')")
        if args.op.strip() == "all":
            ops = [o for o in ops if OPS[o].min_ranks <= 1]
    note(
        f"meshcomm bench: {', '.join(ops)} on {n} ranks, backend {g.backend}, {dtype.name}, "
        f"{len(sizes)} sizes, iters {args.iters or 'adaptive'}, warmup {args.warmup}"
    )
    try:
        results = run_sweep(
            g,
            ops,
            sizes,
            dtype,
            iters=args.iters,
            warmup=args.warmup,
            min_time=args.min_time,
            progress=lambda r: note(progress_line(r)),
        )
    except ValueError as exc:
        _err(str(exc))
        return 2
    bad = [r for r in results if not r.ok]
    if lead:
        sys.stdout.write(format_table(results).rstrip("\n") + "\n")
        sys.stdout.flush()
        meta: dict[str, Any] = {
            "backend": g.backend,
            "ranks": n,
            "dtype": dtype.name,
            "ops": ops,
            "iters": args.iters,
            "warmup": args.warmup,
            "min_time": args.min_time,
        }
        if args.json:
            write_json(args.json, to_json(results, **meta))
        if args.plot:
            from .plot import plot_results

            plot_results(results, args.plot, title=f"meshcomm {g.backend}, {n} ranks, {dtype.name}")
        if bad:
            _err(f"{len(bad)} size(s) returned wrong results; their figures were discarded (see the WRONG rows above)")
    return 1 if bad else 0
