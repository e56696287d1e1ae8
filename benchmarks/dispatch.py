"""Dispatch microbenchmark: OpByOp, Chained, Fused against a multi-controller baseline.

    python benchmarks/dispatch.py            # full run (about 2 minutes on 2 cores)
    python benchmarks/dispatch.py --small    # quick: 16 and 128 devices
    python benchmarks/dispatch.py --json     # one JSON object per line
    python benchmarks/dispatch.py --plot docs/dispatch.png

The logic lives in ``atoll._bench_dispatch``; this file only calls it.
"""

from __future__ import annotations

import sys

from atoll._bench_dispatch import main

if __name__ == "__main__":
    sys.exit(main())
