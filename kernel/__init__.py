"""atoll's actor microkernel: actors, promises, mailboxes, supervision, clocks.

Everything public is re-exported here; the modules beside it are private.
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
from ._clock import VirtualClock as VirtualClock
from ._clock import WallClock as WallClock
from ._clock import wait_idle as wait_idle
from ._errors import ActorCancelled as ActorCancelled
from ._errors import ActorFailed as ActorFailed
from ._errors import ActorStopped as ActorStopped
from ._errors import AtollError as AtollError
from ._errors import BadCall as BadCall
from ._errors import CallCancelled as CallCancelled
from ._errors import MailboxFull as MailboxFull
from ._errors import NoSuchEndpoint as NoSuchEndpoint
from ._errors import RemoteActorError as RemoteActorError
from ._errors import TransportError as TransportError
from ._mailbox import Mailbox as Mailbox
from ._node import NodeActor as NodeActor
from ._node import resolve_actor_class as resolve_actor_class
from ._promise import Promise as Promise
from ._promise import WaitCounter as WaitCounter
from ._promise import count_waits as count_waits
from ._store import BufferMissing as BufferMissing
from ._store import ObjectStore as ObjectStore
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
    "BufferMissing",
    "Call",
    "CallCancelled",
    "Channel",
    "Clock",
    "Directive",
    "EndpointRef",
    "EndpointSpec",
    "Mailbox",
    "MailboxFull",
    "NoSuchEndpoint",
    "NodeActor",
    "ObjectStore",
    "Promise",
    "RemoteActorError",
    "TransportError",
    "VirtualClock",
    "WaitCounter",
    "WallClock",
    "count_waits",
    "endpoint",
    "resolve_actor_class",
    "wait_idle",
]
