"""``python bench/compare.py [options]``: ``meshcomm bench --compare`` from a checkout.

The comparison itself lives in :mod:`meshcomm.bench.compare` (installed with meshcomm);
this script only keeps the checkout's habit of writing to ``bench/results/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from meshcomm.bench.compare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], out_dir=str(Path(__file__).resolve().parent / "results")))
