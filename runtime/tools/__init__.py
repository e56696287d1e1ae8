"""What ``atoll status``, ``timeline``, ``dashboard``, ``top`` and ``down``
run: reading and administering a running cluster.

One room of ``runtime/`` (``docs/architecture.md``); the package
``atoll.runtime`` is the public face of them all."""
