"""The devices' errors: what a device cannot do, said as an ``AtollError``.

Each keeps the builtin base it replaced, so ``except RuntimeError`` (or
``TypeError``) clauses written before still catch it.
"""

from __future__ import annotations

from ..kernel import AtollError

__all__ = ["DeviceError", "UnsupportedKernel"]


class DeviceError(AtollError, RuntimeError):
    """A device cannot run what it was sent: no such JAX device, no shared JAX
    runtime for a gang across hosts, or a collective gang without a rendezvous."""


class UnsupportedKernel(AtollError, TypeError):
    """A device was sent a kernel of a kind it does not run (e.g. a JAX kernel
    on a simulated device)."""
