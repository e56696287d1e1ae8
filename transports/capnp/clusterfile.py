"""Cluster files: where a Cap'n Proto node or cluster listens, and its token.

``atoll up`` and ``atoll node --cluster-file`` write one; ``atoll.connect`` and
``atoll host --cluster-file`` read it. It is written readable by its owner
only, since the token is the key to the cluster; ``atoll up`` puts it in a
private directory by default (:func:`default_cluster_file`), not in the current
one, where ``git add .`` would pick it up.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ...kernel import AtollError

__all__ = ["ClusterFile", "default_cluster_file", "find_cluster_file"]


@dataclass(frozen=True)
class ClusterFile:
    """Where a cluster listens and the token that opens it.

    ``pid`` is the process that wrote it (``atoll up``'s controller), when
    known: ``atoll down`` waits for it to exit, and signals it if it must.
    """

    address: str
    token: bytes
    pid: int | None = None

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write it readable by the owner only (it holds the secret)."""
        fields: dict[str, object] = {"address": self.address, "token": self.token.hex()}
        if self.pid is not None:
            fields["pid"] = self.pid
        data = json.dumps(fields, indent=1)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(data + "\n")

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ClusterFile:
        where = os.fspath(path)
        try:
            data = json.loads(Path(path).read_text())
            pid = None if data.get("pid") is None else int(data["pid"])
            address, token = str(data["address"]), str(data["token"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise AtollError(f"cannot read cluster file {where!r}: {exc}") from None
        try:
            return cls(address, bytes.fromhex(token), pid)
        except ValueError:
            raise AtollError(
                f"cluster file {where!r}: its token is not hexadecimal (atoll up writes "
                "64 hex digits there): start the cluster again, or copy the file it wrote"
            ) from None


def default_cluster_file() -> Path:
    """Where ``atoll up`` writes its cluster file unless told: in a private directory.

    ``$XDG_RUNTIME_DIR/atoll/cluster.json`` when that variable is set, else
    ``~/.atoll/cluster.json``. The directory is made on the way, mode 0700
    (an existing one is tightened to that), since the file holds the token.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    directory = Path(runtime) / "atoll" if runtime else Path.home() / ".atoll"
    _make_private(directory)
    return directory / "cluster.json"


def find_cluster_file() -> Path:
    """The cluster file of the cluster ``atoll up`` started last on this machine.

    That is :func:`default_cluster_file` (each ``atoll up`` overwrites it, and
    removes it when it stops), if it exists; else an :class:`AtollError` that
    says how to start one or name another.
    """
    path = default_cluster_file()
    if not path.exists():
        raise AtollError(
            f"no running cluster found: {path} does not exist. Start one with "
            "`atoll up`, or pass the cluster file that `atoll up --cluster-file` wrote"
        )
    return path


def _make_private(directory: Path) -> None:
    """Make ``directory`` (if missing) and leave it mode 0700; refuse someone else's."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
        if info.st_uid != os.getuid():
            raise AtollError(f"{directory} belongs to another user; name another cluster file")
        if stat.S_IMODE(info.st_mode) != 0o700:
            directory.chmod(0o700)
    except OSError as exc:
        raise AtollError(f"cannot make a private directory {directory}: {exc}") from None
