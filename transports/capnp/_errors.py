"""Errors of the Cap'n Proto transport."""

from __future__ import annotations

from ...kernel import TransportError

__all__ = ["HostLost"]


class HostLost(TransportError):
    """The connection to a peer broke while calls were pending on it."""
