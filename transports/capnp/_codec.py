"""Python values to and from ``Value`` structs of ``atoll.capnp``.

Encoding is synchronous. Decoding is synchronous too, but some values arrive
later: a ``promise`` (a ``Later`` capability) and a ``buffer`` (an array that
must be streamed or pulled in chunks) decode to a kernel :class:`Promise`,
which the receiving actor resolves before its handler runs, like any promise
argument. A ``buffer`` in shared memory on this machine decodes at once, to a
read-only array mapped in place (see :mod:`atoll.transports.dataplane.shm`).

All capnp objects stay on the event-loop thread, and every capability a
decoded value holds is registered with its :class:`Peer`, which drops them all
when the connection closes (a capnp object collected after its loop is gone
aborts the process).
"""

from __future__ import annotations

import io
import pickle
import sys
import traceback
from collections.abc import Iterable, Iterator
from types import FunctionType
from typing import TYPE_CHECKING, Any

import numpy as np

from ...kernel import (
    ActorCancelled,
    ActorRef,
    ActorStopped,
    AtollError,
    BadCall,
    CallCancelled,
    HostLost,
    MailboxFull,
    NoSuchEndpoint,
    Promise,
    RemoteActorError,
    TransportError,
    failed,
)
from ...kernel.lowlevel import counts
from .._base import by_value
from .._imports import find_class
from ..dataplane import bulk, shm
from ..dtypes import dtype_from_wire, raw_bytes, wire_dtype

if TYPE_CHECKING:
    from ._peer import Peer

__all__ = [
    "INLINE_LIMIT",
    "decode",
    "decode_error",
    "encode",
    "encode_actor",
    "encode_error",
    "escaped_error",
    "undecodable",
]

INLINE_LIMIT = 1 << 20  # arrays above this many bytes travel as a BufferRef
_INT64 = (-(1 << 63), (1 << 63) - 1)


def encode(peer: Peer, builder: Any, value: Any) -> None:
    """Fill the ``Value`` ``builder`` with ``value``."""
    if value is None:
        builder.none = None
    elif isinstance(value, bool):
        builder.bool = value
    elif isinstance(value, int) and _INT64[0] <= value <= _INT64[1]:
        builder.int = value
    elif isinstance(value, float):
        builder.float = value
    elif isinstance(value, str):
        builder.text = value
    elif isinstance(value, bytes | bytearray | memoryview):
        builder.bytes = bytes(value)
    elif isinstance(value, list | tuple) and type(value) in (list, tuple):
        items = builder.init("list" if isinstance(value, list) else "tuple", len(value))
        for item_builder, item in zip(items, value, strict=True):
            encode(peer, item_builder, item)
    elif type(value) is dict:
        entries = builder.init("map", len(value))
        for entry, (key, item) in zip(entries, value.items(), strict=True):
            encode(peer, entry.key, key)
            encode(peer, entry.value, item)
    elif type(value) is np.ndarray and raw_bytes(value.dtype):
        _encode_array(peer, builder, value)
    elif isinstance(value, ActorRef):
        encode_actor(peer, builder.init("actor"), value)
    elif isinstance(value, Promise):
        _encode_promise(peer, builder, value)
    else:
        _encode_pickled(peer, builder.init("pickled"), value)


def _encode_array(peer: Peer, builder: Any, array: np.ndarray) -> None:
    array = np.ascontiguousarray(array).reshape(array.shape)  # keeps 0-d arrays 0-d
    counts["array_bytes_out"] += array.nbytes
    if array.nbytes <= INLINE_LIMIT:
        out = builder.init("array")
        out.dtype = wire_dtype(array.dtype)
        out.shape = list(array.shape)
        out.data = array.tobytes()
        bulk.counts["inline_out_bytes"] += array.nbytes
        return
    out = builder.init("buffer")
    out.dtype = wire_dtype(array.dtype)
    out.shape = list(array.shape)
    out.nbytes = array.nbytes
    out.source = peer.serve_buffer(array)
    where = shm.locate(array)  # in shared memory: a reader on this machine maps it
    if where is not None:
        out.shm, out.shmOffset = where
        out.machine = shm.machine_id()


def encode_actor(peer: Peer, builder: Any, ref: ActorRef[Any]) -> None:
    """Fill an ``ActorRef`` struct: the capability and what identifies it."""
    builder.cap = peer.actor_cap(ref)
    builder.id = ref.id
    builder.name = ref.name
    names = peer.endpoint_names(ref)
    if names:
        builder.endpoints = names


def _encode_promise(peer: Peer, builder: Any, promise: Promise[Any]) -> None:
    if promise.done():
        error = promise.exception()
        if error is not None:
            encode_error(builder.init("error"), error)
        else:
            encode(peer, builder, promise.result())
        return
    builder.promise = peer.later_cap(promise)


def _set_aside(obj: Any) -> bool:
    """Whether ``obj`` travels next to a pickle, as a capability (or a pulled buffer)."""
    big_array = type(obj) is np.ndarray and raw_bytes(obj.dtype) and obj.nbytes > INLINE_LIMIT
    return isinstance(obj, ActorRef | Promise) or big_array


class _Pickler(pickle.Pickler):
    """Pickles with actors and promises kept aside, to travel as capabilities.

    By reference, like plain pickle, except for the functions and classes that
    :func:`~atoll.transports._base.by_value` picks: those are pickled by value (``_byvalue``).
    """

    def __init__(self, file: io.BytesIO, buffers: list[Any]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._caps: list[Any] = []

    def reducer_override(self, obj: Any) -> Any:
        # What travels aside is caught here, not by ``persistent_id``, which
        # the pickler calls for every object (ints and strings too: 50 calls
        # for one buffer handle); this is not called for plain values.
        kind = type(obj)
        if _set_aside(obj):
            self._caps.append(obj)
            return _aside, (len(self._caps) - 1,)
        if (kind is FunctionType or isinstance(obj, type)) and by_value(obj):
            from . import _byvalue  # imports cloudpickle: only when a value needs it

            return _byvalue.reduce(obj, _set_aside)
        return NotImplemented


def _encode_pickled(peer: Peer, builder: Any, value: Any) -> None:
    buffers: list[pickle.PickleBuffer] = []
    data = io.BytesIO()
    pickler = _Pickler(data, buffers)
    try:
        pickler.dump(value)
    except Exception as exc:
        why = _unpicklable_function(value) or str(exc)
        raise BadCall(f"cannot send a {type(value).__name__} over the wire: {why}") from exc
    builder.data = data.getvalue()
    caps = builder.init("caps", len(pickler._caps))
    for cap_builder, obj in zip(caps, pickler._caps, strict=True):
        encode(peer, cap_builder, obj)
    raw = builder.init("buffers", len(buffers))
    for i, buffer in enumerate(buffers):
        view = buffer.raw()
        raw[i] = view.tobytes()
        counts["array_bytes_out"] += view.nbytes


def _unpicklable_function(value: Any) -> str | None:
    """Which function in ``value`` (a graph's kernels, a computation's...)
    cannot travel, what it captures that cannot, and what to do; None if no
    function is the cause."""
    for fn in _functions_in(value, depth=6, seen=set()):
        try:
            _Pickler(io.BytesIO(), []).dump(fn)
        except Exception as exc:
            code = fn.__code__
            where = f"{fn.__qualname__} ({code.co_filename}:{code.co_firstlineno})"
            cells = map(_contents, fn.__closure__ or ())
            captured = dict(zip(code.co_freevars, cells, strict=False))
            captured.update((n, fn.__globals__[n]) for n in code.co_names if n in fn.__globals__)
            for name, held in captured.items():
                try:
                    _Pickler(io.BytesIO(), []).dump(held)
                except Exception:
                    return (
                        f"function {where} captures {name!r}, a {type(held).__name__}, which "
                        f"cannot be pickled ({exc}). A function that runs on a host travels "
                        "by value with what it captures: capture plain values (arrays, "
                        "numbers, strings), make the object inside the function, or define "
                        "the function in a module the hosts can import"
                    )
            return f"function {where} cannot be pickled: {exc}"
    return None


def _contents(cell: Any) -> Any:
    """A closure cell's value (None for one not filled yet)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _functions_in(value: Any, depth: int, seen: set[int]) -> Iterator[FunctionType]:
    """The plain functions reachable from ``value`` through containers,
    attributes and ``functools.partial`` (a few levels deep)."""
    if depth < 0 or id(value) in seen or isinstance(value, str | bytes | int | float | np.ndarray):
        return
    seen.add(id(value))
    if type(value) is FunctionType:
        yield value
        return
    if isinstance(value, dict):
        children: Iterable[Any] = value.values()
    elif isinstance(value, list | tuple | set | frozenset):
        children = value
    else:
        try:
            children = [getattr(value, "func", None), *getattr(value, "__dict__", {}).values()]
            children += [getattr(value, s, None) for s in getattr(type(value), "__slots__", ())]
        except Exception:  # an object whose attributes misbehave: not looked into
            return
    for child in children:
        yield from _functions_in(child, depth - 1, seen)


def decode(peer: Peer, reader: Any) -> Any:
    """The Python value of a ``Value`` reader (promises for late parts)."""
    which = reader.which()
    if which == "none":
        return None
    if which in ("bool", "int", "float", "text"):
        return getattr(reader, which)
    if which == "bytes":
        return bytes(reader.bytes)
    if which == "list":
        return [decode(peer, item) for item in reader.list]
    if which == "tuple":
        return tuple(decode(peer, item) for item in reader.tuple)
    if which == "map":
        return {decode(peer, e.key): decode(peer, e.value) for e in reader.map}
    if which == "array":
        return _decode_array(reader.array)
    if which == "buffer":
        return peer.pull_buffer(reader.buffer)
    if which == "actor":
        return peer.remote_ref(reader.actor)
    if which == "promise":
        return peer.remote_promise(reader.promise)
    if which == "error":  # a failed value: the receiver's promise fails too
        return failed(decode_error(reader.error), "failed value")
    if which == "pickled":
        return _decode_pickled(peer, reader.pickled)
    raise AtollError(f"unknown Value kind {which!r}")


def _decode_array(reader: Any) -> np.ndarray:
    shape = tuple(int(n) for n in reader.shape)
    data = bytes(reader.data)  # copy: the message may not outlive the loop
    array = np.frombuffer(data, dtype=dtype_from_wire(str(reader.dtype))).reshape(shape)
    array.flags.writeable = False
    bulk.counts["inline_in_bytes"] += len(data)
    return array


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, caps: list[Any], buffers: list[bytes]) -> None:
        super().__init__(file, buffers=buffers)
        self._caps = caps

    def find_class(self, module: str, name: str) -> Any:
        if name == "_aside" and module == __name__:  # a value that travelled aside
            return self._caps.__getitem__
        return find_class(super().find_class, module, name)  # kept; says what is missing


def _aside(index: int) -> Any:
    """Stands, in a pickle, for the value sent aside as capability ``index``
    (the unpickler resolves it to that value; never called)."""
    raise AtollError(f"value {index} travelled aside: only the codec's unpickler reads it")


def _decode_pickled(peer: Peer, reader: Any) -> Any:
    caps = [decode(peer, cap) for cap in reader.caps]
    buffers = [bytes(b) for b in reader.buffers]
    data = bytes(reader.data)
    pulls = [  # big arrays still on their way (not mapped from shared memory)
        i
        for i, cap in enumerate(reader.caps)
        if cap.which() == "buffer" and isinstance(caps[i], Promise)
    ]
    if not pulls:
        return _Unpickler(io.BytesIO(data), caps, buffers).load()
    # big arrays inside the object are still being pulled: unpickle once here
    result: Promise[Any] = Promise("pickled")

    async def finish() -> None:
        try:
            for i in pulls:
                caps[i] = await caps[i]
            result.set_result(_Unpickler(io.BytesIO(data), caps, buffers).load())
        except Exception as exc:
            result.set_exception(exc)

    peer.track(result)  # failed with HostLost if the connection goes first
    peer.spawn(finish())
    return result


# -- errors --------------------------------------------------------------------
def encode_error(builder: Any, error: BaseException, actor: str = "", endpoint: str = "") -> None:
    """Describe ``error`` in an ``Error`` struct builder.

    An exception that is not an atoll error is boxed first (:func:`_box`, with
    ``actor`` and ``endpoint`` if known), so its type and traceback travel too.
    """
    if not isinstance(error, AtollError):
        error = _box(error, actor, endpoint)
    builder.kind, builder.message = _kind(error), str(error)
    if isinstance(error, RemoteActorError):
        builder.actor, builder.endpoint = error.actor, error.endpoint
        builder.excType, builder.traceback = error.exc_type, error.remote_traceback
        builder.message = error.message
    elif isinstance(error, BadCall):
        builder.message = error.message
        builder.excType = error.exc_type or _type_name(error.__cause__ or error)
        builder.traceback = error.remote_traceback or _format(error)
    elif isinstance(error, CallCancelled):
        builder.actor, builder.endpoint, builder.message = error.actor, error.endpoint, error.reason
    elif isinstance(error, ActorStopped):
        builder.actor, builder.message = error.actor, error.reason
    elif isinstance(error, MailboxFull):
        builder.actor, builder.message = error.actor, str(error.capacity)
    elif isinstance(error, NoSuchEndpoint):
        builder.actor, builder.endpoint = error.actor, error.endpoint
    else:
        builder.excType = f"{type(error).__module__}.{type(error).__qualname__}"


def _kind(error: BaseException) -> str:
    kinds: list[tuple[type[BaseException], str]] = [
        (RemoteActorError, "remote"),
        (ActorCancelled, "cancelled"),
        (ActorStopped, "stopped"),
        (CallCancelled, "call_cancelled"),
        (MailboxFull, "mailbox_full"),
        (NoSuchEndpoint, "no_such_endpoint"),
        (BadCall, "bad_call"),
        (HostLost, "host_lost"),
        (TransportError, "transport"),
    ]
    for cls, kind in kinds:
        if isinstance(error, cls):
            return kind
    return "atoll"


def decode_error(reader: Any) -> AtollError:
    """The exception an ``Error`` struct describes."""
    kind, actor, endpoint = reader.kind, reader.actor, reader.endpoint
    message = reader.message
    if kind == "remote":
        return RemoteActorError(actor, endpoint, reader.excType, message, reader.traceback)
    if kind == "cancelled":
        return ActorCancelled(actor, message)
    if kind == "stopped":
        return ActorStopped(actor, message)
    if kind == "call_cancelled":
        return CallCancelled(actor, endpoint, message)
    if kind == "mailbox_full":
        return MailboxFull(actor, int(message or 0))
    if kind == "no_such_endpoint":
        return NoSuchEndpoint(actor, endpoint)
    if kind == "bad_call":
        return BadCall(message, reader.excType, reader.traceback)
    if kind == "host_lost":
        return HostLost(message)
    if kind == "transport":
        return TransportError(message)
    return _atoll_error(str(reader.excType), message)


def _atoll_error(type_name: str, message: str) -> AtollError:
    """An atoll error by the name of its type, as itself when that type is one
    of atoll's own, made from its message (``StoreFull``, ``QuotaExceeded``...);
    else a plain ``AtollError`` (names from the wire import nothing new)."""
    module_name, _, name = type_name.rpartition(".")
    module = sys.modules.get(module_name) if module_name.startswith("atoll.") else None
    kind = getattr(module, name, None)
    if isinstance(kind, type) and issubclass(kind, AtollError):
        try:
            return kind(message)
        except Exception:  # a constructor that needs more than a message
            pass
    return AtollError(message)


def _type_name(error: BaseException) -> str:
    """The qualified name of ``error``'s type, e.g. ``builtins.ZeroDivisionError``."""
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def _format(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def _box(error: BaseException, actor: str = "", endpoint: str = "") -> RemoteActorError:
    """``error`` (raised on this side, outside any endpoint) as a
    :class:`RemoteActorError` that keeps its type, message and traceback."""
    return RemoteActorError(
        actor or "<remote>", endpoint or "<result>", _type_name(error), str(error), _format(error)
    )


def undecodable(error: Exception, actor: str, endpoint: str) -> BadCall:
    """What a call whose arguments failed to decode here answers: a
    :class:`BadCall` with the decoding error's type, message and traceback."""
    cause = f"{type(error).__name__}: {error}"
    message = f"{actor}.{endpoint}: its arguments could not be decoded: {cause}"
    return BadCall(message, _type_name(error), _format(error))


_TRACEBACK = "Traceback (most recent call last):"


def escaped_error(description: str, peer: str) -> RemoteActorError | None:
    """The error in a capnp exception's ``description`` that holds a Python
    traceback (an exception let out of a server method), whole; else None.

    Its last line names the type and message; ``peer`` stands in for the
    actor, which capnp does not say.
    """
    start = description.find(_TRACEBACK)
    if start < 0:
        return None
    text = description[start:].rstrip()
    exc_type, _, message = text.splitlines()[-1].partition(": ")
    if "." not in exc_type:
        exc_type = f"builtins.{exc_type}"
    return RemoteActorError(peer, "<capnp server>", exc_type, message, text)
