"""atoll's actor microkernel: actors, promises, mailboxes, supervision, clocks.

Everything public is re-exported here; the modules beside it are private.
Transports reach the few internals they need through
:mod:`atoll.kernel.lowlevel`. The kernel imports nothing else of atoll: it is
the bottom layer (see ``docs/architecture.md``).
"""

from ._actor import Actor as Actor
from ._actor import ActorRef as ActorRef
from ._actor import Call as Call
from ._actor import Channel as Channel
from ._actor import Directive as Directive
from ._actor import EndpointRef as EndpointRef
from ._actor import EndpointSpec as EndpointSpec
from ._actor import endpoint as endpoint
from ._clock import Clock as Clock
from ._clock import Timer as Timer
from ._clock import VirtualClock as VirtualClock
from ._clock import WallClock as WallClock
from ._clock import current_clock as current_clock
from ._clock import fail_after as fail_after
from ._clock import move_on_after as move_on_after
from ._clock import use_clock as use_clock
from ._clock import wait_idle as wait_idle
from ._combinators import all_settled as all_settled
from ._combinators import as_promise as as_promise
from ._combinators import failed as failed
from ._combinators import first_settled as first_settled
from ._combinators import flatten as flatten
from ._combinators import forward as forward
from ._combinators import log_failure as log_failure
from ._combinators import then as then
from ._combinators import value_of as value_of
from ._combinators import when_settled as when_settled
from ._counts import process_counters as process_counters
from ._errors import ActorCancelled as ActorCancelled
from ._errors import ActorFailed as ActorFailed
from ._errors import ActorStopped as ActorStopped
from ._errors import AtollError as AtollError
from ._errors import BadCall as BadCall
from ._errors import BadMailbox as BadMailbox
from ._errors import CallCancelled as CallCancelled
from ._errors import HostLost as HostLost
from ._errors import MailboxFull as MailboxFull
from ._errors import NoSuchEndpoint as NoSuchEndpoint
from ._errors import NotAnActor as NotAnActor
from ._errors import NotRunning as NotRunning
from ._errors import RemoteActorError as RemoteActorError
from ._errors import TransportError as TransportError
from ._errors import UsageError as UsageError
from ._mailbox import Mailbox as Mailbox
from ._node import NodeActor as NodeActor
from ._node import resolve_actor_class as resolve_actor_class
from ._promise import Promise as Promise
from ._promise import WaitCounter as WaitCounter
from ._promise import count_waits as count_waits
from ._system import ActorContext as ActorContext
from ._system import ActorSystem as ActorSystem

__all__ = [
    "Actor",
    "ActorCancelled",
    "ActorContext",
    "ActorFailed",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "AtollError",
    "BadCall",
    "BadMailbox",
    "Call",
    "CallCancelled",
    "Channel",
    "Clock",
    "Directive",
    "EndpointRef",
    "EndpointSpec",
    "HostLost",
    "Mailbox",
    "MailboxFull",
    "NoSuchEndpoint",
    "NodeActor",
    "NotAnActor",
    "NotRunning",
    "Promise",
    "RemoteActorError",
    "Timer",
    "TransportError",
    "UsageError",
    "VirtualClock",
    "WaitCounter",
    "WallClock",
    "all_settled",
    "as_promise",
    "count_waits",
    "current_clock",
    "endpoint",
    "fail_after",
    "failed",
    "first_settled",
    "flatten",
    "forward",
    "log_failure",
    "move_on_after",
    "process_counters",
    "resolve_actor_class",
    "then",
    "use_clock",
    "value_of",
    "wait_idle",
    "when_settled",
]
