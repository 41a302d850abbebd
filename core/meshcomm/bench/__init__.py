"""``meshcomm bench``: time meshcomm's collectives the way nccl-tests does.

Run it on every rank of a job, e.g. ``meshcomm launch -n 2 -- -m meshcomm bench --op all_sum``.

* :mod:`.sizes` parses ``8B:64MiB[:F]`` into message sizes;
* :mod:`.collectives` says, per operation, what each rank sends, what it must get back
  and how bus bandwidth relates to algorithm bandwidth;
* :mod:`.measure` times one call pattern (warm-up, barrier-aligned iterations, the
  slowest rank per iteration) for meshcomm or any other library;
* :mod:`.runner` sweeps operations and sizes over a meshcomm group, checking every result;
* :mod:`.report` prints progress, the table and JSON; :mod:`.plot` draws the optional PNG;
* :mod:`.cli` adds the ``bench`` subcommand to ``meshcomm``;
* :mod:`.compare` (``meshcomm bench --compare``) runs one job per installed backend and raw
  peer (:mod:`.peers`: mpi4py, torch gloo, MLX) and prints them side by side, with the
  machine's limits (:mod:`.limits`).
"""

from __future__ import annotations

from .collectives import OPS, Collective, bus_factor
from .measure import Stats, Sync, time_op
from .runner import Result, ResultCheckError, run_sweep
from .sizes import format_size, parse_size, parse_sizes

__all__ = [
    "OPS",
    "Collective",
    "bus_factor",
    "Stats",
    "Sync",
    "time_op",
    "Result",
    "ResultCheckError",
    "run_sweep",
    "format_size",
    "parse_size",
    "parse_sizes",
]
