"""Process-wide counters of the control plane's messages, for tools.

``atoll bench controlplane`` reads them in every process of a cluster to say
how many actor messages and Cap'n Proto calls one run costs, and where. Each
is a plain integer bumped on the event loop's thread: a dictionary store per
message, cheap enough to stay on in production.
"""

from __future__ import annotations

import os
import time

__all__ = ["COUNTS", "process_counters"]

COUNTS: dict[str, int] = {
    "actor_messages": 0,  # calls enqueued on a local actor's mailbox
    "capnp_calls_out": 0,  # Cap'n Proto calls this process made (Actor.call/send, Later.get)
    "capnp_calls_in": 0,  # Cap'n Proto calls this process served
    "socket_writes": 0,  # writes of Cap'n Proto's streams and of lanes (a burst each)
    "bytes_out": 0,  # bytes this process wrote to sockets: Cap'n Proto, lanes, bulk streams
    # bytes of arrays this process handed to others: inside Cap'n Proto calls
    # and run lanes' messages, or offered for them to read (shared memory,
    # streams); not the small values that ride inside buffer handles, which
    # their holders have already
    "array_bytes_out": 0,
    "lane_messages_out": 0,  # one-way messages sent on lanes (transports/oneway.py)
    "lane_messages_in": 0,  # ... and received
    "answers_from_hosts": 0,  # a client's calls to the controller a device's host answered
    "runs_leased": 0,  # a client's runs sent straight to a device's host, under a lease
}


def process_counters() -> dict[str, float]:
    """This process's pid, its CPU seconds so far (user and system, all
    threads), and the message counters above."""
    return {"pid": os.getpid(), "cpu_s": time.process_time(), **COUNTS}
