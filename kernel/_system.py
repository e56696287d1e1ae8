"""The actor runtime of one process: cells, supervision and the system.

An :class:`ActorSystem` owns an anyio task group. Every actor runs as one task
in it (its *cell*): the task builds the actor, runs ``on_start``, then takes
messages from the mailbox one at a time. A message's promise arguments are
awaited in the cell before the handler runs, which is how promises are
"resolved on the receiving side".

Failure handling follows a supervision tree. When an actor fails (its
``on_start`` raised, or an endpoint raised with ``fail_on_error``), its parent's
synchronous ``on_child_failed`` picks a :class:`Directive`: restart the child in
place (same mailbox, same references), stop it, or escalate, in which case the
parent fails too. Failures that reach the top are recorded in
``system.failures`` and logged.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import anyio
import sniffio
from anyio.abc import TaskGroup

from ._actor import Actor, ActorRef, Call, Directive, EndpointSpec
from ._clock import Clock, VirtualClock, current_clock
from ._counts import COUNTS
from ._errors import (
    ActorCancelled,
    ActorFailed,
    ActorStopped,
    AtollError,
    CallCancelled,
    NoSuchEndpoint,
    NotAnActor,
    NotRunning,
    RemoteActorError,
    UsageError,
)
from ._mailbox import Mailbox
from ._promise import Promise
from ._soon import call_soon, outside_tasks

__all__ = ["ActorContext", "ActorSystem"]

A = TypeVar("A", bound=Actor)
_log = logging.getLogger("atoll.kernel")
_current_cell: contextvars.ContextVar[_Cell | None] = contextvars.ContextVar(
    "atoll_current_cell", default=None
)


def running_cell() -> _Cell | None:
    """The cell whose own task is running this code, or None.

    ``_current_cell`` alone cannot tell: a task created from a cell's task
    inherits a copy of its context, the variable included. Cap'n Proto does
    that to every server method it dispatches in a turn of its event loop
    that a cell's call scheduled (the turn runs in the context of whoever
    woke the loop), so an ``Actor.stop`` arriving from a client could look
    like the actor stopping itself, return at once, and leave the running
    call unanswered. Only the cell's own task counts.
    """
    cell = _current_cell.get()
    if cell is None or cell.task_id != anyio.get_current_task().id:
        return None
    return cell


class _Done:
    """A call that :meth:`_Cell._begin` ran to its end, and how (for supervision)."""

    __slots__ = ("failure",)

    def __init__(self, failure: BaseException | None) -> None:
        self.failure = failure


class _Failure(Exception):
    """Internal: unwinds a cell's message loop when the actor fails."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class ActorContext:
    """What a running actor knows about its place in the system."""

    def __init__(self, cell: _Cell) -> None:
        self._cell = cell

    @property
    def ref(self) -> ActorRef[Any]:
        """This actor's own reference (to hand out to others)."""
        return self._cell.ref

    @property
    def name(self) -> str:
        return self._cell.actor_name

    @property
    def parent(self) -> ActorRef[Any] | None:
        return self._cell.parent.ref if self._cell.parent is not None else None

    @property
    def system(self) -> ActorSystem:
        return self._cell.system

    @property
    def clock(self) -> Clock:
        return self._cell.system.clock

    @property
    def children(self) -> list[ActorRef[Any]]:
        return [child.ref for child in self._cell.children]

    @property
    def restarts(self) -> int:
        """How many times this actor has been restarted so far."""
        return self._cell.restarts

    @property
    def stopping(self) -> bool:
        """True once the actor began to stop (its tasks cancelled, ``on_stop``
        running or run), until it restarts: work it would start now (a task,
        a push from a callback) would outlive it."""
        return self._cell.stopping

    @property
    def queued(self) -> int:
        """Messages waiting in this actor's mailbox now (the one it handles
        is not among them): an actor that batches what it sends can tell
        whether more of the same is coming in this turn."""
        return len(self._cell.mailbox)

    def spawn(
        self, cls: type[A], *args: Any, name: str | None = None, **kwargs: Any
    ) -> ActorRef[A]:
        """Start a child actor supervised by this one; returns at once."""
        return self._cell.system._spawn(cls, args, kwargs, name, parent=self._cell)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` as a task beside this actor's message loop.

        For work that waits on something other than a message (a device
        watching its accelerator): the task is cancelled when the actor
        stops or restarts, and an error it raises is logged, never lost.
        Returns at once. Raises ``ActorStopped`` once the actor is stopping
        (:attr:`stopping`): the task would outlive it.
        """
        self._cell.start_task(fn, args)


class _Cell:
    """The runtime side of one actor; also its in-process :class:`Channel`."""

    def __init__(
        self,
        system: ActorSystem,
        cls: type[Actor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str,
        parent: _Cell | None,
    ) -> None:
        self.system = system
        self.cls = cls
        self._args = args
        self._kwargs = kwargs
        self.actor_id = f"{system.name}/{name}"
        self.actor_name = name
        self.parent = parent
        self.children: list[_Cell] = []
        self.mailbox: Mailbox[Call] = Mailbox(name, cls.mailbox_capacity, cls.mailbox_slack)
        self.ref: ActorRef[Any] = ActorRef(self)
        self.instance: Actor | None = None
        self.restarts = 0
        self.handled = 0
        self.received = 0
        self._current: Call | None = None
        self._idle = False  # waiting for a message: an inline call may run at once
        self._inlined: set[str] = set()  # endpoints one call of which ran inline this pass
        self.stopping = False  # its tasks cancelled, on_stop running or run (until a restart)
        self._context: contextvars.Context | None = None  # its task's, once it runs
        self._call_scope: anyio.CancelScope | None = None
        self._life_scope: anyio.CancelScope | None = None
        self._end_error: AtollError | None = None
        self._kill_error: AtollError | None = None
        self._outside_failure: BaseException | None = None
        self._done = anyio.Event()
        self.task_id: int | None = None  # the cell's own task, once it runs
        self._tasks: set[anyio.CancelScope] = set()  # its background tasks (start_soon)

    # -- Channel --------------------------------------------------------
    @property
    def endpoints(self) -> Mapping[str, EndpointSpec]:
        return self.cls.__endpoints__

    def submit(self, call: Call) -> None:
        if self._idle and not self.mailbox and self._inlines(call):
            try:
                if not self._inlined:  # the next call of this pass to it queues (_inlines)
                    call_soon(self._pass_over)
            except RuntimeError:  # no loop runs here: the actor's task takes it
                pass
            else:
                self._run_inline(call)
                return
        self._prepare(call)
        try:
            self.mailbox.put_nowait(call)
        except ActorStopped as exc:
            call.promise._reject(exc)
        else:
            self.received += 1
            COUNTS["actor_messages"] += 1

    async def submit_wait(self, call: Call) -> None:
        self._prepare(call)
        try:
            await self.mailbox.put(call)
        except ActorStopped as exc:
            call.promise._reject(exc)
        else:
            self.received += 1
            COUNTS["actor_messages"] += 1

    def _inlines(self, call: Call) -> bool:
        """Whether ``call`` may run now, in the caller's step (``inline``):
        one call per endpoint per pass of the event loop at most, so that
        calls that come together (a lane's read of many) still queue together
        and the actor sees them as a batch (``ActorContext.queued``); a call
        to another endpoint (an island's own batch of completions, then a
        run) does not wait behind it."""
        if call.endpoint in self._inlined:
            return False
        spec = self.cls.__endpoints__.get(call.endpoint)
        if spec is None or not spec.inline or self.cls.fail_on_error or self.mailbox.closed:
            return False
        return not spec.resolve_args or not (_has_promise(call.args) or _has_promise(call.kwargs))

    def _run_inline(self, call: Call) -> None:
        """Handle ``call`` at once, as the idle actor's task would have
        (``EndpointSpec.inline``): it is this actor's only call meanwhile."""
        instance = self.instance
        assert instance is not None  # idle: serving
        self._prepare(call)  # (a promise it forwards may be cancelled, as a queued call's)
        self.received += 1
        COUNTS["actor_messages"] += 1
        self._current, self._idle = call, False
        self._inlined.add(call.endpoint)
        try:
            result = getattr(instance, call.endpoint)(*call.args, **call.kwargs)
        except Exception as exc:
            call.promise._reject(self._box(call.endpoint, exc))
        except BaseException:  # (its caller's to handle; the call is not left pending)
            call.promise._reject(ActorCancelled(self.actor_name, "interrupted"))
            raise
        else:
            if _is_awaitable(result) and not isinstance(result, Promise):
                getattr(result, "close", lambda: None)()  # a coroutine: never awaited
                error = UsageError(f"{call.endpoint} is inline and returned an awaitable")
                call.promise._reject(self._box(call.endpoint, error))
            else:
                self._settle(call, result)
        finally:
            self._current, self._idle = None, True
            self.handled += 1

    def _pass_over(self) -> None:
        self._inlined.clear()

    def _prepare(self, call: Call) -> None:
        spec = self.cls.__endpoints__.get(call.endpoint)
        if spec is None or spec.share_args:
            call.args = tuple(map(_share, call.args))
            if call.kwargs:
                call.kwargs = {k: _share(v) for k, v in call.kwargs.items()}
        call.promise._canceller = lambda reason: self._cancel_call(call, reason)

    async def stop(self, grace: float | None) -> None:
        self._close(ActorStopped(self.actor_name, "stopped"))
        if running_cell() is self:
            return  # an actor stopping itself: it ends after this call
        if grace is None:
            await self._done.wait()
            return
        with anyio.move_on_after(grace):
            await self._done.wait()
        if not self._done.is_set():
            await self.cancel(f"did not stop within {grace} s")

    async def cancel(self, reason: str) -> None:
        self._terminate(ActorCancelled(self.actor_name, reason))
        if running_cell() is not self:
            await self._done.wait()

    # -- stopping -------------------------------------------------------
    def _close(self, error: AtollError) -> None:
        if self._end_error is None:
            self._end_error = error
        for call in self.mailbox.close(str(error)):
            call.promise._reject(error)

    def _terminate(self, error: AtollError, failure: BaseException | None = None) -> None:
        """Close the mailbox and cancel whatever the actor is doing now."""
        self._close(error)
        self._kill_error = self._kill_error or error
        if failure is not None and self._outside_failure is None:
            self._outside_failure = failure
        if self._life_scope is not None:
            self._life_scope.cancel()

    def _cancel_call(self, call: Call, reason: str) -> bool:
        if call.promise.done():
            return False
        if call is self._current:
            if self._call_scope is None:  # running, and not cancellable (EndpointSpec)
                return False
            call.cancelled = reason
            self._call_scope.cancel()
            return True
        call.cancelled = reason
        call.promise._reject(CallCancelled(self.actor_name, call.endpoint, reason))
        return True

    # -- the cell's task ------------------------------------------------
    async def main(self) -> None:
        _current_cell.set(self)
        self._context = contextvars.copy_context()  # what its tasks start with
        self.task_id = anyio.get_current_task().id
        try:
            while True:
                restart = False
                with anyio.CancelScope() as life:
                    self._life_scope = life
                    restart = await self._incarnation()
                self._life_scope = None
                if not restart:
                    break
                self.restarts += 1
        finally:
            self._life_scope = None
            self._finish()

    async def _incarnation(self) -> bool:
        """Run one instance; return True if it must be restarted."""
        error: BaseException | None = None
        instance: Actor | None = None
        self.stopping = False
        try:
            instance = self.cls(*self._args, **self._kwargs)
            instance._atoll_ctx = ActorContext(self)
            self.instance = instance
            await instance.on_start()
            await self._serve(instance)
        except _Failure as failure:
            error = failure.error
        except Exception as exc:  # on_start or the constructor raised
            error = exc
        except anyio.get_cancelled_exc_class():
            await self._teardown(instance)
            if self._outside_failure is None:
                raise
            error = self._outside_failure
            return self._supervise(error)
        await self._teardown(instance)
        error = error or self._outside_failure  # closed under us by a failure
        return error is not None and self._supervise(error)

    async def _serve(self, instance: Actor) -> None:
        while True:
            self._idle = True  # (calls that may run inline can, while it waits)
            try:
                call = await self.mailbox.get()
            except ActorStopped:
                return
            finally:
                self._idle = False
            if call.cancelled is None:
                await self._handle(instance, call)
            del call  # a handled call's arguments and promise are nobody's business here

    async def _handle(self, instance: Actor, call: Call) -> None:
        self._current = call
        failure: BaseException | None = None
        try:
            begun = self._begin(instance, call)
            if isinstance(begun, _Done):  # it ran to its end: nothing to cancel
                failure = begun.failure
            elif not self.cls.__endpoints__[call.endpoint].cancellable:  # no scope to pay for
                failure = await begun
            else:
                with anyio.CancelScope() as scope:
                    self._call_scope = scope
                    failure = await begun
                if scope.cancelled_caught:
                    reason = call.cancelled or "cancelled"
                    call.promise._reject(CallCancelled(self.actor_name, call.endpoint, reason))
        except anyio.get_cancelled_exc_class():
            error = self._kill_error or ActorCancelled(self.actor_name, "cancelled")
            call.promise._reject(error)
            raise
        finally:
            self._current = None
            self._call_scope = None
            self.handled += 1
        if failure is not None:
            raise _Failure(failure)

    def _begin(
        self, instance: Actor, call: Call
    ) -> _Done | Coroutine[Any, Any, BaseException | None]:
        """Start one call. A handler that needs no waiting (no argument to
        resolve, a plain method) runs to its end here, with no cancel scope
        to pay for; anything else is returned, to be awaited in one."""
        spec = self.cls.__endpoints__.get(call.endpoint)
        if spec is None:
            call.promise._reject(NoSuchEndpoint(self.actor_name, call.endpoint))
            return _Done(None)
        args, kwargs = call.args, call.kwargs
        if spec.resolve_args and (_has_promise(args) or _has_promise(kwargs)):
            return self._invoke(instance, call)
        try:
            result = getattr(instance, call.endpoint)(*args, **kwargs)
        except Exception as exc:
            call.promise._reject(self._box(call.endpoint, exc))
            return _Done(exc if self.cls.fail_on_error else None)
        if _is_awaitable(result) and not isinstance(result, Promise):
            return self._await_handler(call, result)
        self._settle(call, result)
        return _Done(None)

    async def _await_handler(self, call: Call, running: Awaitable[Any]) -> BaseException | None:
        """Await a handler that :meth:`_begin` started; settle its promise."""
        try:
            result = await running
        except Exception as exc:
            call.promise._reject(self._box(call.endpoint, exc))
            return exc if self.cls.fail_on_error else None
        self._settle(call, result)
        return None

    def _settle(self, call: Call, result: Any) -> None:
        if isinstance(result, Promise):  # forwarded: settle later, don't block
            call.promise._follow(result)
        else:
            call.promise._resolve(result)

    async def _invoke(self, instance: Actor, call: Call) -> BaseException | None:
        """Run one call; settle its promise; return an error that fails the actor."""
        spec = self.cls.__endpoints__.get(call.endpoint)
        if spec is None:
            call.promise._reject(NoSuchEndpoint(self.actor_name, call.endpoint))
            return None
        args, kwargs = call.args, call.kwargs
        if spec.resolve_args:
            try:
                args, kwargs = await _resolve_all(args, kwargs)
            except Exception as exc:  # an input promise failed: so does this call
                call.promise._reject(exc)
                return None
        try:
            result = getattr(instance, call.endpoint)(*args, **kwargs)
            if _is_awaitable(result) and not isinstance(result, Promise):
                result = await result
        except Exception as exc:
            call.promise._reject(self._box(call.endpoint, exc))
            return exc if self.cls.fail_on_error else None
        if isinstance(result, Promise):  # forwarded: settle later, don't block
            call.promise._follow(result)
        else:
            call.promise._resolve(result)
        return None

    def _box(self, endpoint: str, exc: Exception) -> AtollError:
        """What the caller gets: the caller's own mistake as itself, anything
        else boxed with the actor, the endpoint and the traceback."""
        if isinstance(exc, UsageError):
            return exc
        kind = type(exc)
        return RemoteActorError(
            self.actor_name,
            endpoint,
            f"{kind.__module__}.{kind.__qualname__}",
            str(exc),
            "".join(traceback.format_exception(exc)),
        )

    def start_task(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        """A background task of this actor (see ``ActorContext.start_soon``).
        From a plain callback of an asyncio loop (a promise settled by a
        timer or a socket), the task starts in the context of the actor's
        own task, as it would from there: the loop's context lacks what the
        runtime keeps in context variables (the clock, the Cap'n Proto
        runtime's mark)."""
        if self.system._tg is None:
            raise NotRunning("the ActorSystem is not running (use `async with`)")
        if self.stopping:
            raise ActorStopped(self.actor_name, "stopping: it starts no task")
        if self._context is not None and outside_tasks():
            self._context.copy().run(self._spawn, fn, args, True)
        else:
            self._spawn(fn, args, False)

    def _spawn(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], say: bool) -> None:
        if say:  # (no task to ask: anyio learns the library from sniffio's variable)
            sniffio.current_async_library_cvar.set("asyncio")
        scope = anyio.CancelScope()
        self._tasks.add(scope)

        async def run() -> None:
            try:
                with scope:
                    await fn(*args)
            except Exception:
                _log.exception("a task of %s failed", self.actor_name)
            finally:
                self._tasks.discard(scope)

        assert self.system._tg is not None
        self.system._tg.start_soon(run, name=f"task:{self.actor_name}")

    async def _teardown(self, instance: Actor | None) -> None:
        """Stop the children and run ``on_stop``; immune to cancellation."""
        self.stopping = True  # no task starts now: none would be stopped
        for scope in list(self._tasks):
            scope.cancel()
        with anyio.CancelScope(shield=True):
            for child in list(self.children):
                await child.cancel(f"parent {self.actor_name} stopped")
            if instance is not None:
                with anyio.move_on_after(self.system.on_stop_timeout) as timer:
                    try:
                        await instance.on_stop()
                    except Exception:
                        _log.exception("%s.on_stop raised", self.actor_name)
                if timer.cancelled_caught:
                    _log.error(
                        "%s.on_stop gave up after %s s",
                        self.actor_name,
                        self.system.on_stop_timeout,
                    )

    def _supervise(self, error: BaseException) -> bool:
        """Ask the parent what to do about ``error``; True means restart."""
        failed = ActorFailed(self.actor_name, error)
        directive = self._ask_parent(failed)
        if directive is Directive.RESTART and self.restarts >= self.cls.max_restarts:
            directive = Directive.ESCALATE
        if directive is Directive.RESTART:
            if self._outside_failure is not None:
                self._reopen()  # it was closed when a child's failure took it down
            self._outside_failure = None
            return True
        self._close(ActorStopped(self.actor_name, f"failed: {error!r}"))
        if directive is Directive.ESCALATE:
            if self.parent is not None:
                self.parent._terminate(
                    ActorStopped(self.parent.actor_name, f"child {self.actor_name} failed"),
                    failure=failed,
                )
            else:
                self.system._record_failure(failed)
        return False

    def _reopen(self) -> None:
        """A fresh mailbox after an escalation closed the old one.

        Calls queued in the old one already failed with ``ActorStopped``; the
        reference stays valid and new calls reach the restarted instance.
        """
        self.mailbox = Mailbox(self.actor_name, self.cls.mailbox_capacity, self.cls.mailbox_slack)
        self._end_error = self._kill_error = None

    def _ask_parent(self, failed: ActorFailed) -> Directive:
        parent = self.parent
        if parent is None:
            return self.system.supervise(self.ref, failed)
        if parent.instance is None or parent._end_error is not None:
            return Directive.STOP
        try:
            return parent.instance.on_child_failed(self.ref, failed)
        except Exception:
            _log.exception("%s.on_child_failed raised", parent.actor_name)
            return Directive.ESCALATE

    def _finish(self) -> None:
        self._close(self._end_error or ActorStopped(self.actor_name, "stopped"))
        self.instance = None
        if self.parent is not None and self in self.parent.children:
            self.parent.children.remove(self)
        self.system._cells.pop(self.actor_id, None)
        self._done.set()


class ActorSystem:
    """All actors of one process, and the task group they run in.

    Use it as an async context manager. Leaving the block cancels every actor
    that is still running (their pending calls fail with ``ActorStopped``);
    call :meth:`shutdown` first to let them finish their current call.

    Args:
        name: prefix of actor ids; unique per process is enough.
        clock: the time of simulated devices and of the actors' timeouts
            (default: :func:`current_clock`); a ``VirtualClock`` is driven
            automatically.
        supervise: decides about top-level actors that fail; the default
            stops them and records the failure in ``failures``.
        on_stop_timeout: how long an actor's ``on_stop`` may run before it is
            abandoned, so that stopping never hangs.
    """

    def __init__(
        self,
        name: str = "local",
        *,
        clock: Clock | None = None,
        supervise: Callable[[ActorRef[Any], ActorFailed], Directive] | None = None,
        on_stop_timeout: float = 10.0,
    ) -> None:
        self.name = name
        self.clock: Clock = clock if clock is not None else current_clock()
        self.failures: list[ActorFailed] = []
        self.on_stop_timeout = on_stop_timeout
        self._supervise = supervise
        self._cells: dict[str, _Cell] = {}
        self._ids = itertools.count()
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> ActorSystem:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if isinstance(self.clock, VirtualClock):
            self._tg.start_soon(self.clock.run, name="atoll-virtual-clock")
        return self

    async def __aexit__(self, *exc_info: object) -> bool | None:
        assert self._tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self.shutdown(grace=0)
            self._tg.cancel_scope.cancel()
        finally:
            tg, self._tg = self._tg, None
            try:
                result = await tg.__aexit__(*exc_info)  # type: ignore[arg-type]
            except BaseExceptionGroup as group:
                if _only(group, exc_info[1]):
                    return False  # the body's own error: let it through unwrapped
                raise
        return result

    def spawn(
        self, cls: type[A], *args: Any, name: str | None = None, **kwargs: Any
    ) -> ActorRef[A]:
        """Start a top-level actor; returns its reference at once."""
        return self._spawn(cls, args, kwargs, name, parent=None)

    def _spawn(
        self,
        cls: type[A],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
        parent: _Cell | None,
    ) -> ActorRef[A]:
        if self._tg is None:
            raise NotRunning("the ActorSystem is not running (use `async with`)")
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise NotAnActor(f"spawn needs an Actor subclass, got {cls!r}")
        number = next(self._ids)
        name = name or f"{cls.__name__}-{number}"
        if parent is not None:
            name = f"{parent.actor_name}/{name}"
        cell = _Cell(self, cls, args, kwargs, name, parent)
        if cell.actor_id in self._cells:
            raise AtollError(f"an actor named {name!r} is already running")
        self._cells[cell.actor_id] = cell
        if parent is not None:
            parent.children.append(cell)
        self._tg.start_soon(cell.main, name=f"actor:{name}")
        return cell.ref

    def lookup(self, name: str) -> ActorRef[Any]:
        """The reference of a running actor, by name."""
        cell = self._cells.get(f"{self.name}/{name}")
        if cell is None:
            raise AtollError(f"no running actor named {name!r}")
        return cell.ref

    def stats(self, ref: ActorRef[Any]) -> dict[str, int]:
        """Mailbox and restart counters of a local actor (for tests and tools)."""
        cell = self._cells.get(ref.id)
        if cell is None:
            raise AtollError(f"{ref.name} is not running here")
        return {
            "received": cell.received,
            "queued": len(cell.mailbox),
            "handled": cell.handled,
            "restarts": cell.restarts,
            "blocked_puts": cell.mailbox.blocked_puts,
        }

    async def shutdown(self, grace: float | None = 0) -> None:
        """Stop every top-level actor (children go with their parents)."""
        tops = [cell for cell in self._cells.values() if cell.parent is None]
        for cell in tops:
            if grace == 0:
                await cell.cancel("actor system shut down")
            else:
                await cell.stop(grace)

    def supervise(self, ref: ActorRef[Any], failed: ActorFailed) -> Directive:
        """The top of the supervision tree; override by passing ``supervise=``."""
        if self._supervise is not None:
            return self._supervise(ref, failed)
        return Directive.ESCALATE

    def _record_failure(self, failed: ActorFailed) -> None:
        self.failures.append(failed)
        _log.error("top-level actor failed: %s", failed)


def _only(group: BaseExceptionGroup[BaseException], error: object) -> bool:
    return error is not None and len(group.exceptions) == 1 and group.exceptions[0] is error


def _as_is(value: Any) -> Any:
    return value


_share: Callable[[Any], Any] = _as_is


def share_arguments_with(share: Callable[[Any], Any]) -> None:
    """How a call's arguments are handed to an actor of this process.

    ``share(value)`` runs on each argument as the call is queued. The kernel
    itself passes values as they are; the in-process transport installs a
    policy that hands numpy arrays over as read-only views, so a receiver can
    no more write into the sender's memory than it could over a socket.
    """
    global _share
    _share = share


async def _resolve_all(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not any(_has_promise(a) for a in args) and not any(_has_promise(v) for v in kwargs.values()):
        return args, kwargs
    new_args = tuple([await _resolve(a) for a in args])
    new_kwargs = {k: await _resolve(v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _has_promise(value: Any) -> bool:
    if type(value) in _PLAIN:  # the common arguments, at the cost of one look-up
        return False
    if isinstance(value, Promise):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_has_promise, value))
    if isinstance(value, dict):
        return any(map(_has_promise, value.values()))
    return False


_PLAIN = frozenset({str, int, float, bool, type(None), bytes})


async def _resolve(value: Any) -> Any:
    if isinstance(value, Promise):
        return await value
    if isinstance(value, list):
        return [await _resolve(v) for v in value]
    if isinstance(value, tuple):
        return tuple([await _resolve(v) for v in value])
    if isinstance(value, dict):
        return {k: await _resolve(v) for k, v in value.items()}
    return value


def _is_awaitable(value: object) -> bool:
    return hasattr(value, "__await__")
