# atoll's wire contract (Cap'n Proto RPC).
#
# A peer connects over TCP, bootstraps a `Gate`, and proves it holds the
# cluster's secret token with `Gate.login`. Only then does it receive a
# capability: the `Actor` of the remote node (atoll's NodeActor). Everything
# else is reached from there: `node.call("spawn", ...)` returns an `Actor`, and
# calls on it return values, more actors, or promises of either.
#
# Calls pipeline natively. `Actor.call` returns `actor` (set when the value is
# an actor) and `later` (the result, as a capability). A client may call
# methods on both before the call has returned:
#   - `call(...).actor.call(...)` is delivered to the returned actor as soon as
#     it exists, without a round trip through the client;
#   - `call(...).later` may be passed as a `Value.promise` argument to other
#     calls; the receiver resolves it with `Later.get`.
# (Cap'n Proto cannot pipeline through union members, which is why these two
# live outside `Value`.)
#
# Large arrays travel as a `BufferRef`. A reader on the holder's machine maps
# its shared-memory segment (`shm`), zero-copy. Elsewhere it asks the `Buffer`
# capability to `open` a bulk byte stream (a plain TCP connection, authorized
# by a one-time ticket), and if that cannot be had, pulls the bytes in chunks
# with `read`, several at a time, so no single message is large.
@0xb4ebc2e1e1a2baa3;

struct Value {
  # Any value an endpoint takes or returns.
  union {
    none @0 :Void;
    bool @1 :Bool;
    int @2 :Int64;
    float @3 :Float64;
    text @4 :Text;
    bytes @5 :Data;
    list @6 :List(Value);
    tuple @7 :List(Value);
    map @8 :List(Entry);          # keys may be any Value
    array @9 :NdArray;            # inline, for arrays up to the inline limit
    buffer @10 :BufferRef;        # pull-based, for larger arrays
    actor @11 :ActorRef;
    promise @12 :Later;           # a value that is not there yet
    error @13 :Error;             # a failed result
    pickled @14 :Pickled;         # Python-only values (dataclasses, ...)
  }
}

struct Entry {
  key @0 :Value;
  value @1 :Value;
}

struct NdArray {
  dtype @0 :Text;                 # numpy dtype string, e.g. "<f4"
  shape @1 :List(UInt64);
  data @2 :Data;                  # C-order bytes
}

struct BufferRef {
  dtype @0 :Text;
  shape @1 :List(UInt64);
  nbytes @2 :UInt64;
  source @3 :Buffer;
  shm @4 :Text;                   # the shared-memory segment holding the bytes, or ""
  shmOffset @5 :UInt64;           # where in it they start
  machine @6 :Text;               # the holder's machine id: `shm` is valid there only
}

interface Buffer {
  # The bytes of one array.
  read @0 (offset :UInt64, length :UInt32) -> (data :Data);
  # One chunk (at most 2^29-1 bytes): the fallback.

  open @1 () -> (address :Text, ticket :Data);
  # A bulk stream: connect to `address` (HOST:PORT), send `ticket`, receive an
  # 8-byte big-endian length and then that many bytes. The ticket is good for
  # one connection, for a short while; a wrong one closes the connection.
}

struct ActorRef {
  cap @0 :Actor;
  id @1 :Text;                    # unique in the cluster
  name @2 :Text;
  endpoints @3 :List(Text);       # lets a client check calls before sending
}

struct Error {
  # kind: "remote" (the endpoint raised), "stopped", "cancelled" (the actor was
  # cancelled), "call_cancelled", "mailbox_full", "no_such_endpoint",
  # "bad_call", "host_lost" (a host further along broke away), "transport",
  # "atoll" (any other atoll error).
  kind @0 :Text;
  actor @1 :Text;
  endpoint @2 :Text;
  excType @3 :Text;
  message @4 :Text;
  traceback @5 :Text;
}

struct Pickled {
  # Python pickle (protocol 5). Actors and promises inside it are replaced by
  # indexes into `caps`; out-of-band buffers (numpy data) are in `buffers`.
  # Accepted only from peers that logged in with the cluster token.
  data @0 :Data;
  caps @1 :List(Value);
  buffers @2 :List(Data);
}

interface Later {
  # A result that may not exist yet; `get` returns when it does.
  get @0 () -> (result :Value, actor :Actor);
}

interface Actor {
  call @0 (endpoint :Text, args :List(Value), kwargs :List(Entry), callId :UInt64)
      -> (result :Value, actor :Actor, later :Later);
  # Enqueue and run; returns when the endpoint finished (or failed: `result`
  # is then an `error`). A full mailbox answers at once with "mailbox_full".

  send @1 (endpoint :Text, args :List(Value), kwargs :List(Entry), callId :UInt64)
      -> (later :Later);
  # Wait for room in the mailbox, enqueue, and return at once; the result comes
  # from `later.get()`. This is the back-pressured way in.

  stop @2 (grace :Float64) -> ();
  # Stop after the running call; cancel it after `grace` s (negative: no limit).

  cancel @3 (reason :Text) -> ();
  # Stop at once, cancelling the running call.

  cancelCall @4 (callId :UInt64, reason :Text) -> ();
  # Cancel one call this client made on this actor (`callId` as it sent it):
  # a queued call never runs, a running one is cancelled. Sent before the
  # client's next call, so "cancel, then carry on" keeps its order, which
  # merely dropping the question (Finish) does not promise.
}

interface Gate {
  # The bootstrap capability. A wrong token closes the connection.
  login @0 (token :Data) -> (node :ActorRef);
}
