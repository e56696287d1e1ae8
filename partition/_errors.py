"""What the partitioner raises: atoll errors that say what is wrong with the input."""

from __future__ import annotations

from ..kernel import AtollError

__all__ = ["GraphError", "InfeasibleError", "RepairTimeout"]


class GraphError(AtollError, ValueError):
    """A graph the partitioner cannot use as it is given (no nodes, edges
    that go backwards, nothing to size the chiplets' memory by)."""


class InfeasibleError(AtollError):
    """No assignment of this graph to these chiplets meets every constraint."""


class RepairTimeout(InfeasibleError):
    """The solver found no valid assignment within its time limit (none proved
    impossible either). Searches score such a candidate 0 and go on."""
