"""``atoll.partition``: the multi-chip partitioner (see ``docs/partition.md``).

The implementation lives in :mod:`atoll.schedulers.partition`; this module is
the short name the issue and the docs use: ``atoll.partition.search(...)``,
``atoll.partition.from_jax(...)``.
"""

from .schedulers.partition import *  # noqa: F403
from .schedulers.partition import __all__ as __all__
