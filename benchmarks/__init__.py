"""atoll's benchmarks: ``atoll bench NAME`` runs ``benchmarks/NAME.py``.

This package lives in the source tree only (it is not in the wheel): in a
checkout installed with ``pip install -e .`` it is ``atoll.benchmarks``. Each
module runs as a script (``python benchmarks/dispatch.py``) or a module
(``python -m atoll.benchmarks.dispatch``) and prints :class:`~._common.Row`
values as a table or, with ``--json``, as one JSON object per line.

* ``dispatch``: Pathways' dispatch microbenchmark, on simulated devices;
* ``pipeline16_processes``: the 16-step pipeline over real host processes;
* ``transport``: atoll over Cap'n Proto against raw pycapnp (and Ray);
* ``handoff``: W5, 64 MiB made on one host process and read on another
  (shared memory, or ``--stream`` for the bulk stream);
* ``partition``: the partitioner's methods on BERT, against the paper;
* ``peers_ray``: runs the Ray peer scripts (``shared/peers``) beside them;
* ``faults``: random faults injected into a cluster of real processes
  (hosts killed, frozen, links cut, clients killed), with its invariants;
* ``load``: 10,000 calls in flight against one actor, 64 clients at once,
  and a well-behaved client's latency meanwhile;
* ``_common``: the row type, the table and the timing helpers they share.
"""
