"""The partitioner benchmark: ``python benchmarks/partition.py [--small] [--json]``.

The logic lives in :mod:`atoll.schedulers.partition.bench`.
"""

from __future__ import annotations

import sys

from atoll.schedulers.partition.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
