"""The API contract as checks that run on every rank of a real job.

Each ``check_*`` function takes the world :class:`~meshcomm.Group` and raises
AssertionError (with the rank and what differed) when the backend breaks the
contract. Every rank can compute every other rank's input, so each rank checks its
own result against NumPy. Run all of them under a launcher::

    meshcomm launch -n 4 --backend NAME -- python -m meshcomm.testing.contract [--more]

which exits non-zero when any check fails on any rank. The first round's checks are
:mod:`meshcomm.testing.contract_first` (:data:`CHECKS`); ``--more`` adds the second round's
(:mod:`meshcomm.testing.contract_more`: all_to_all, gather, scatter, reduce, object
collectives, ``out=``, ``async_op``, ``close``). This module runs them: :func:`run_checks`
and the command line. The checks and their helpers stay importable from here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable

import meshcomm as mc

# re-exported: backend authors' tests import the checks and helpers from this module
from .checks_base import (  # noqa: F401
    LARGE,
    SHAPES,
    _dtypes,
    _expect,
    _identical_everywhere,
    _raises,
    _same,
    rank_input,
)
from .contract_first import (  # noqa: F401
    CHECKS,
    check_all_gather,
    check_barrier,
    check_broadcast,
    check_float_results_identical,
    check_identity,
    check_large_and_noncontiguous,
    check_reductions,
    check_send_recv,
    check_special_semantics,
    check_split,
    check_sum_scatter,
)
from .contract_more import ALL_CHECKS

__all__ = ["CHECKS", "JSON_MARK", "run_checks", "main", "rank_input"]


def run_checks(
    g: mc.Group,
    checks: list[Callable[[mc.Group], None]] | None = None,
    verbose: bool = False,
    on_result: Callable[[str, str | None, float], None] | None = None,
) -> list[tuple[str, str]]:
    """Run ``checks`` on ``g``; returns (name, error) for each failure on this rank.

    A failing check may leave peers mid-collective, so the remaining checks are skipped
    after the first failure that is not an assertion about results. ``on_result(name,
    error or None, seconds)`` is called after each check that ran.
    """
    failures: list[tuple[str, str]] = []
    for check in checks or CHECKS:
        t0 = time.perf_counter()
        error: str | None = None
        stop = False
        try:
            check(g)
        except AssertionError as exc:
            error = str(exc)
        except Exception:
            error = traceback.format_exc()
            stop = True
        if error is not None:
            failures.append((check.__name__, error))
        if on_result is not None:
            on_result(check.__name__, error, time.perf_counter() - t0)
        if stop:
            break
        if verbose:
            print(f"rank {g.rank()}: {check.__name__} ok ({time.perf_counter() - t0:.2f} s)", file=sys.stderr)
    return failures


#: prefix of the line ``--json`` prints (found anywhere in a line: launchers add their own prefix)
JSON_MARK = "MESHCOMM-CONTRACT-JSON "


def main(argv: list[str] | None = None) -> int:
    """Run the contract on the world group of this job; exit status 1 on any failure."""
    p = argparse.ArgumentParser(prog="python -m meshcomm.testing.contract")
    p.add_argument("--backend", default=None, help="backend to init (default: MLX_BACKEND / any)")
    p.add_argument("-k", default="", help="run only checks whose name contains this")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--more",
        action="store_true",
        help="also run the second round's checks (all_to_all, gather, scatter, reduce, "
        "object collectives, out=, async_op, close): meshcomm.testing.contract_more",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help=f"also print one line '{JSON_MARK.strip()} {{...}}' per rank: every check's "
        "status (passed, failed, not run), error and seconds",
    )
    args = p.parse_args(argv)
    g = mc.init(strict=True, backend=args.backend)
    pool = ALL_CHECKS if args.more else CHECKS
    checks = [c for c in pool if args.k in c.__name__]
    results: dict[str, dict[str, object]] = {
        c.__name__: {"status": "not run", "error": None, "seconds": 0.0} for c in checks
    }

    def record(name: str, error: str | None, seconds: float) -> None:
        results[name] = {
            "status": "passed" if error is None else "failed",
            "error": error,
            "seconds": round(seconds, 3),
        }

    failures = run_checks(g, checks, verbose=args.verbose, on_result=record)
    for name, err in failures:
        print(f"FAILED rank {g.rank()} {name}: {err}", file=sys.stderr)
    if args.json:
        report = {
            "rank": g.rank(),
            "size": g.size(),
            "backend": g.backend,
            "checks": [{"name": name, **r} for name, r in results.items()],
        }
        print(JSON_MARK + json.dumps(report), flush=True)
    print(
        f"rank {g.rank()}/{g.size()} on {g.backend}: {len(checks) - len(failures)} passed, {len(failures)} failed "
        f"({'compiled' if g._lane is not None else 'pure-Python'} call path)",
        flush=True,
    )
    if all(r["status"] != "not run" for r in results.values()):
        # every rank reports before any exits (a launcher stops the others when one fails)
        try:
            g.barrier()
        except Exception:
            pass
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
