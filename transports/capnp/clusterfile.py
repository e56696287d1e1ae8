"""Cluster files: where a Cap'n Proto node or cluster listens, and its token.

``atoll up`` and ``atoll node --cluster-file`` write one; ``atoll.connect`` and
``atoll host --cluster-file`` read it. It is written readable by its owner
only, since the token is the key to the cluster.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ...kernel import AtollError

__all__ = ["ClusterFile"]


@dataclass(frozen=True)
class ClusterFile:
    """Where a cluster listens and the token that opens it."""

    address: str
    token: bytes

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write it readable by the owner only (it holds the secret)."""
        data = json.dumps({"address": self.address, "token": self.token.hex()}, indent=1)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(data + "\n")

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ClusterFile:
        try:
            data = json.loads(Path(path).read_text())
            return cls(str(data["address"]), bytes.fromhex(data["token"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AtollError(f"cannot read cluster file {os.fspath(path)!r}: {exc}") from None
