"""What a JAX device runs for one node: a traced function with its shardings.

Tracing (:mod:`atoll.runtime.tracing`) makes one :class:`JaxKernel` per node;
a :class:`~atoll.devices.jax.JaxDevice` gang runs it. It lives here,
below the runtime, so that devices need nothing from the layer above them.
Importing it does not import JAX.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["JaxKernel", "fn_key"]


@dataclass(frozen=True, eq=False)
class JaxKernel:
    """A traced function of flat array inputs to a flat list of outputs.

    ``in_specs``/``out_specs`` give one ``PartitionSpec`` per flat input and
    output, over the axes of the slice the node runs on. JAX gangs always meet
    at a barrier, because their leader runs the whole sharded program. A node
    whose slice spans host processes runs as one multi-process SPMD program
    (``devices/jax/multi.py``), in which each host's leader reads the whole
    inputs (``every_host_reads``); ``single_host`` makes an in-process
    cluster, where hosts share one JAX runtime, refuse a slice over several
    hosts.
    """

    fn: Callable[..., Any]
    name: str
    in_specs: tuple[Any, ...]
    out_specs: tuple[Any, ...]
    collective: bool = True
    single_host: bool = True
    every_host_reads: bool = True


def fn_key(fn: Any) -> Any:
    """What identifies ``fn`` in a compile cache. A plain function sent over
    the wire comes back as the same object each time (the codec interns it);
    a ``functools.partial`` comes back as a new one, so it is keyed by its
    function and arguments when they are hashable (an argument that is not
    hashable leaves the partial object itself as the key)."""
    if isinstance(fn, functools.partial):
        args = tuple((type(v), v) for v in fn.args)  # 2 and 2.0 compile apart
        keywords = tuple(sorted((k, type(v), v) for k, v in fn.keywords.items()))
        key = (fn_key(fn.func), args, keywords)
        try:
            hash(key)
        except TypeError:
            return fn
        return key
    return fn
