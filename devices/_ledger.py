"""What each owner (a client session) holds on one host, and what it may hold.

An :class:`OwnerLedger` sits beside a host's object store (one per store,
shared by the host actor and its devices, all in one process). The store
tells it of every buffer stored and freed; devices tell it the device time
they spent on each owner's gangs. It answers three questions:

* how many bytes and buffers an owner holds here, and how much device time
  it used (for ``client.status()``);
* whether storing ``nbytes`` more for an owner would pass its byte quota
  (:meth:`OwnerLedger.check` raises :class:`QuotaExceeded`), so a client over
  its quota fails its *own* work, never another client's;
* whether a buffer belongs to the session asking for it (:func:`check_owner`
  raises :class:`NotYours`), so guessing another client's buffer id gives an
  error, not the data.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ..kernel import AtollError

__all__ = ["NotYours", "OwnerLedger", "QuotaExceeded", "SessionEnded", "check_owner"]

_CLOSED_KEPT = 4096  # ended owners remembered, so that their late work stores nothing


class QuotaExceeded(AtollError, RuntimeError):
    """A session asked for more than its quota (store bytes or queued gangs)."""


class SessionEnded(AtollError, RuntimeError):
    """Work of a session that has ended: nothing of it is stored any more."""


class NotYours(AtollError, KeyError):
    """The buffer is not held by the session that asked for it (it is another
    session's, or was never stored, or was freed: the asker cannot tell which)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else "not held by this session"


class OwnerLedger:
    """Per-owner bytes, buffers and device seconds on one host; byte quotas."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.buffers: Counter[str] = Counter()
        self.device_s: defaultdict[str, float] = defaultdict(float)
        self.quotas: dict[str, int] = {}  # owner -> most bytes it may hold here
        self._closed: dict[str, None] = {}  # owners whose session ended, newest last

    def added(self, owner: str, nbytes: int) -> None:
        """The store now holds a buffer of ``nbytes`` for ``owner``."""
        self.bytes[owner] += nbytes
        self.buffers[owner] += 1

    def removed(self, owner: str, nbytes: int) -> None:
        """A buffer of ``owner`` was freed."""
        self.bytes[owner] -= nbytes
        self.buffers[owner] -= 1
        if self.buffers[owner] <= 0:
            del self.bytes[owner], self.buffers[owner]

    def charge(self, owner: str, seconds: float) -> None:
        """A device here spent ``seconds`` on ``owner``'s work."""
        if seconds > 0:
            self.device_s[owner] += seconds

    def set_quota(self, owner: str, max_bytes: int | None) -> None:
        """At most ``max_bytes`` held here for ``owner`` (None: no limit)."""
        if max_bytes is None:
            self.quotas.pop(owner, None)
        else:
            self.quotas[owner] = max_bytes

    def check_open(self, owner: str) -> None:
        """Raise :class:`SessionEnded` if ``owner``'s session has ended."""
        if owner in self._closed:
            raise SessionEnded(f"session {_public(owner)} has ended: its work is dropped")

    def check(self, owner: str, nbytes: int) -> None:
        """Raise :class:`QuotaExceeded` if ``nbytes`` more would pass ``owner``'s
        quota, :class:`SessionEnded` if its session has ended."""
        self.check_open(owner)
        quota = self.quotas.get(owner)
        if quota is not None and self.bytes[owner] + nbytes > quota:
            raise QuotaExceeded(
                f"session {_public(owner)} would hold {self.bytes[owner] + nbytes} bytes "
                f"in this host's store; its quota is {quota} bytes (free some buffers)"
            )

    def over(self, owner: str, nbytes: int) -> bool:
        """Whether :meth:`check` would raise (it says why)."""
        if owner in self._closed:
            return True
        quota = self.quotas.get(owner)
        return quota is not None and self.bytes[owner] + nbytes > quota

    def forget(self, owner: str) -> None:
        """The owner's session ended: drop its quota and device time, and
        refuse to store anything more for it (its gangs still running would
        leave buffers nobody frees)."""
        self.quotas.pop(owner, None)
        self.device_s.pop(owner, None)
        if owner:
            self._closed[owner] = None
            while len(self._closed) > _CLOSED_KEPT:
                del self._closed[next(iter(self._closed))]

    def usage(self) -> dict[str, dict[str, float]]:
        """Per owner: ``bytes``, ``buffers`` and ``device_s`` held or used here."""
        owners = set(self.bytes) | set(self.device_s)
        return {
            owner: {
                "bytes": self.bytes[owner],
                "buffers": self.buffers[owner],
                "device_s": self.device_s.get(owner, 0.0),
            }
            for owner in owners
        }


def check_owner(buffer_id: str, held_by: str, asker: str) -> None:
    """Raise :class:`NotYours` unless ``asker`` may read buffer ``buffer_id``.

    An empty ``asker`` is the runtime itself (devices, the controller), which
    may read anything; a session reads only what is labelled with its own
    owner label (unlabelled buffers included).
    """
    if asker and held_by and held_by != asker:
        raise NotYours(f"no buffer {buffer_id!r} held by session {_public(asker)}")


def _public(owner: str) -> str:
    """An owner label without its secret part (``"alice#3"``), safe to show."""
    return owner.split(".", 1)[0]
