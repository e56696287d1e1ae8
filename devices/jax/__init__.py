"""The JAX backend: devices that own a JAX device each (``JaxDevice``), the
host that joins several processes into one JAX runtime (``JaxHost``), fused
segments of consecutive gangs (``fused.py``) and the multi-process runtime
(``multi.py``). Importing it imports JAX; ``atoll.devices`` does not.
"""

from .device import JaxDevice as JaxDevice
from .device import JaxHost as JaxHost

__all__ = ["JaxDevice", "JaxHost"]
