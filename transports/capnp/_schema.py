"""Loads ``atoll.capnp`` once; every capnp module of atoll uses this copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import capnp

__all__ = ["SCHEMA_PATH", "schema"]

SCHEMA_PATH = Path(__file__).with_name("atoll.capnp")
schema: Any = capnp.load(str(SCHEMA_PATH))
