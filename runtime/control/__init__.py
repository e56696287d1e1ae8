"""The controller's process: the controller, island schedulers, the planner,
tenancy and sessions, elastic moves, resources, and the control plane's
metrics.

One room of ``runtime/`` (``docs/architecture.md``); the package
``atoll.runtime`` is the public face of them all."""
