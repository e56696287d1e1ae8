"""Launching a cluster: the one cluster spec, ``local_cluster`` (one
process) and the process cluster (``atoll up``, ``atoll host``).

One room of ``runtime/`` (``docs/architecture.md``); the package
``atoll.runtime`` is the public face of them all."""
