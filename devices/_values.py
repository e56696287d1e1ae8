"""The plain values devices work with: handles, computations, costs and stats.

A :class:`BufferHandle` names a buffer in a host's store and travels
anywhere; a :class:`Computation` is what ``cluster.run(c, device, inputs)``
runs; a :class:`CostModel` times simulated devices; :class:`DeviceStats`
is how busy a device was; an :class:`Arrival` is a pushed input as its
reader finds it. Nothing here is asynchronous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernel import ActorRef
from ..transports.dtypes import dtype_from_wire, dtype_name, raw_bytes, wire_dtype
from ..transports.inproc import read_only
from ._host_api import HostEndpoints

__all__ = [
    "INLINE_VALUE_BYTES",
    "Arrival",
    "BufferHandle",
    "Computation",
    "CostModel",
    "DeviceStats",
]

INLINE_VALUE_BYTES = 1 << 14  # outputs up to this size ride along in their handle


@dataclass(frozen=True)
class BufferHandle:
    """Where a buffer lives: its id in the store of ``host``, and its type.

    A small output (up to ``INLINE_VALUE_BYTES``) also carries its value
    (read-only): whoever gets the handle, in this process or across the
    wire, reads it without asking the holder, so fetching a scalar result
    or chaining small values between hosts costs no extra round trip. The
    buffer still lives in the store, for reference counts and owners; since
    a stored value never changes, a small handle still reads after its
    buffer was freed (a large one then raises ``BufferMissing``).
    """

    id: str
    host: ActorRef[HostEndpoints]
    host_id: int
    device_id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    island: int = 0
    address: str = ""  # the holder's capnp address, in multi-process clusters
    value: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        buffer_id: str,
        array: Any,
        host: ActorRef[HostEndpoints],
        host_id: int,
        device_id: int,
        island: int,
        address: str = "",
    ) -> BufferHandle:
        """The handle of ``array``, stored as ``buffer_id`` on that host,
        whose process serves at ``address`` ('' : in this process)."""
        shape, dtype, nbytes = tuple(array.shape), dtype_name(array.dtype), int(array.nbytes)
        small = isinstance(array, np.ndarray) and nbytes <= INLINE_VALUE_BYTES
        value = read_only(array) if small else None  # nobody writes into a stored value
        return cls(
            buffer_id,
            host,
            host_id,
            device_id,
            shape,
            dtype,
            nbytes,
            island,
            address,
            value,
        )

    def __copy__(self) -> BufferHandle:
        """Another handle of the same buffer (another reference, for whoever
        counts handles), made from the fields as they are."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its fields in order, a small value as its bytes: a
        handle travels with every run's answer, and the default (a state
        dictionary, the value's array by numpy's own reduction) cost twice
        as much to send and to read."""
        value = self.value
        small: Any = value  # a dtype that is not plain bytes goes as numpy pickles it
        if value is not None and raw_bytes(value.dtype):
            small = (value.tobytes(), wire_dtype(value.dtype), value.shape)
        fields = (self.id, self.host, self.host_id, self.device_id, self.shape, self.dtype)
        return _handle, (*fields, self.nbytes, self.island, self.address, small)


def _handle(
    buffer_id: str,
    host: ActorRef[HostEndpoints],
    host_id: int,
    device_id: int,
    shape: tuple[int, ...],
    dtype: str,
    nbytes: int,
    island: int,
    address: str,
    small: tuple[bytes, str, tuple[int, ...]] | np.ndarray | None,
) -> BufferHandle:
    """A handle as :meth:`BufferHandle.__reduce__` sent it."""
    value: np.ndarray | None
    if isinstance(small, tuple):
        data, value_dtype, value_shape = small
        value = read_only(np.frombuffer(data, dtype_from_wire(value_dtype)).reshape(value_shape))
    else:  # none, or a dtype numpy pickled
        value = small
    fields = (buffer_id, host, host_id, device_id, shape, dtype, nbytes, island, address)
    return BufferHandle(*fields, value)


@dataclass(frozen=True)
class Computation:
    """A function to run on a device, with the work it represents.

    ``fn`` maps numpy inputs to one numpy output. ``flops`` is what the cost
    model turns into device time (simulated devices spend exactly that).
    ``collective``: run as a gang over several devices, its shards first meet
    at a barrier, like the participants of an all-reduce.
    """

    name: str
    fn: Callable[..., Any]
    flops: float = 0.0
    collective: bool = False


@dataclass(frozen=True)
class CostModel:
    """How long things take on a simulated device.

    compute time = flops / flops_per_s; a transfer between hosts takes
    link_latency_s + bytes / link_bytes_per_s; on one host it is free. A
    transfer between islands crosses the "datacenter network" instead, with
    ``dcn_*`` figures (None: the same as the link inside an island).
    """

    flops_per_s: float = 1e12
    link_bytes_per_s: float = 10e9
    link_latency_s: float = 20e-6
    dcn_bytes_per_s: float | None = None
    dcn_latency_s: float | None = None

    def compute_time(self, flops: float) -> float:
        return flops / self.flops_per_s

    def transfer_time(self, nbytes: int, across_islands: bool = False) -> float:
        if across_islands:
            latency = self.dcn_latency_s if self.dcn_latency_s is not None else self.link_latency_s
            rate = (
                self.dcn_bytes_per_s if self.dcn_bytes_per_s is not None else self.link_bytes_per_s
            )
            return latency + nbytes / rate
        return self.link_latency_s + nbytes / self.link_bytes_per_s


@dataclass(frozen=True)
class DeviceStats:
    """How busy a device was: busy time over the time since it started."""

    device_id: int
    host_id: int
    island: int
    computations: int
    busy_s: float
    transfer_s: float
    elapsed_s: float
    in_flight: int = 0  # gangs enqueued on the accelerator, not known finished
    peak_in_flight: int = 0  # the most that ever were at once

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class Arrival:
    """A pushed input as its reader finds it in the store: the local copy's
    handle, and the modelled link time the transfer took (simulated devices
    spend it when they take the input). ``local`` is False for a redirect:
    the handle is the producer's own, read from where it is."""

    handle: BufferHandle
    transfer_s: float
    local: bool = True
