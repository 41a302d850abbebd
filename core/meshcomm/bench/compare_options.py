"""The options of ``meshcomm bench --compare`` and ``python -m meshcomm.bench.compare``.

Both commands take the same options, so they live here, below both: :mod:`.cli` builds
``meshcomm bench``'s parser without importing the comparison itself (:mod:`.compare`,
which starts the jobs), and :mod:`.compare` builds its own parser without importing the
``meshcomm bench`` command.
"""

from __future__ import annotations

import argparse

__all__ = ["COMPARE_SIZES", "add_compare_arguments"]

#: the sweep of ``--compare`` unless told otherwise (x4: half the jobs of x2)
COMPARE_SIZES = "8B:64MiB:4"


def add_compare_arguments(p: argparse._ActionsContainer, *, out_dir: str = "meshcomm-compare") -> None:
    """``--compare``'s own options (:mod:`.compare`; ``--sizes`` and ``--min-time`` are the sweep's)."""
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts (default 2 4)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every job this many times, keep each size's lowest median (default 1)",
    )
    p.add_argument("--systems", help="comma list of systems to run (default: all installed)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job before it is abandoned")
    p.add_argument("--out-dir", default=out_dir, help=f"where compare.{{json,md,png}} go (default {out_dir})")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--tag", help="append -TAG to every system name (e.g. mpich, for a run in an MPICH venv)")
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="keep N foreign processes spinning on the CPU during every job (a busy machine; default 0)",
    )
