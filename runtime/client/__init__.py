"""The user's process: the client (``Cluster``, ``ArrayRef``), its batching
of runs, its ownership of buffers, ``connect``, checkpoints, timelines, and
its half of a session.

One room of ``runtime/`` (``docs/architecture.md``); the package
``atoll.runtime`` is the public face of them all."""
