"""The data plane: how array bytes travel, beside the calls that name them.

Actor calls carry small values inline; large ones go by reference. Between
processes of one machine an array sits in a shared-memory segment
(:mod:`.shm`) that its reader maps in place; between machines its reader
pulls it over a bulk byte stream, authorized by a single-use ticket
(:mod:`.bulk`); a producer pushes small outputs to a reader's host over a
push lane, one way (:mod:`.lane`). Hosts reach these through the
``DataPlane`` they are given (``devices/_plane.py``); the Cap'n Proto
codec and peer use them for arrays in calls. See ``docs/transport.md``.
"""
