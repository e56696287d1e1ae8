"""W4 over real processes: 16 steps of 2 ms, each on its own host process.

``python benchmarks/pipeline16_processes.py [--runs N] [--json]`` starts a
controller here and 16 host processes (``local_cluster(transport="capnp")``),
builds the 16-node chain as one program, and times it three ways,
interleaved, N runs each (default 15):

* ``parallel``: parallel asynchronous dispatch, the default: every node is
  sent at once, and each producer pushes its output straight to the next
  host;
* ``parallel_no_push``: the same dispatch with pushing turned off, so each
  input reaches its reader through the controller's promise;
* ``sequential``: each node is sent after the one before it returned.

It prints the medians beyond the 32 ms floor and the ratio of sequential to
parallel overhead (``--json``: the rows of ``atoll bench dispatch --json``).
``atoll bench dispatch --processes`` runs the same measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from atoll.benchmarks import dispatch as bench


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three ways and print their medians (or, with ``--json``, the rows)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = asyncio.run(bench.pipeline_processes(args.runs))
    if args.json:
        for row in rows:
            print(row.json())
        return 0
    floor_ms = bench.STAGE_S * 16 * 1e3
    print(f"16 steps x 2 ms on 16 host processes, median of {args.runs} runs beyond the")
    print(f"{floor_ms:.0f} ms floor:")
    by_case = {row.case: row.value or 0.0 for row in rows}
    for case, value in by_case.items():
        print(f"  {case:<45} {value:7.1f} ms")
    parallel = by_case["pipeline16_parallel_overhead_processes"]
    sequential = by_case["pipeline16_sequential_overhead_processes"]
    print(f"  sequential / parallel overhead: {sequential / max(parallel, 1e-9):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
