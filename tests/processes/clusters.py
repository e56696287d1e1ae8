"""Clusters the tests of this group share: ``atoll up`` as a child process,
and a controller served over Cap'n Proto from the test's own process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from atoll.devices import CostModel, SimDevice
from atoll.kernel import ActorSystem
from atoll.runtime import ClusterSpec
from atoll.runtime.deploy.process import ClusterBuilder, ClusterInfo
from atoll.transports.capnp import CapnpTransport, capnp_runtime

REPOSITORY = Path(__file__).resolve().parents[2]  # where "-m tests.<group>.<module>" runs


def atoll_child(args: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[Any]:
    """``python -m atoll.cli ARGS`` as a child (posix_spawn: no fork of this process)."""
    command = [sys.executable, "-m", "atoll.cli", *args]
    return subprocess.Popen(command, env=env, close_fds=False, **popen)


@contextlib.contextmanager
def atoll_up(
    args: list[str], cluster_file: Path | None = None, token: str | None = None, **env: str
) -> Iterator[subprocess.Popen[str]]:
    """``atoll up ARGS`` (with ``env`` added, and ``ATOLL_TOKEN`` if a
    ``token`` is given); on the way out SIGTERM it, and it must exit
    cleanly. Without ``cluster_file``, ``atoll up`` picks its default."""
    where = ["--cluster-file", str(cluster_file)] if cluster_file else []
    environment = dict(os.environ, **env, **({"ATOLL_TOKEN": token} if token else {}))
    up = atoll_child(["up", *args, *where], environment, stdout=subprocess.PIPE, text=True)
    assert up.stdout is not None
    try:
        yield up
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        up.stdout.close()


@contextlib.asynccontextmanager
async def served_cluster(
    token: bytes, devices: int = 2, store_bytes: int | None = None
) -> AsyncIterator[tuple[str, ClusterInfo, ActorSystem]]:
    """A controller served on 127.0.0.1 with ``token``, its one host of
    ``devices`` simulated devices joined in-process: its address, the
    cluster, the test process's actor system."""
    spec = ClusterSpec(
        1, 1, devices, cost=CostModel(), device_cls=SimDevice, store_bytes=store_bytes
    )
    async with capnp_runtime(), ActorSystem("controller") as system:
        listener = await CapnpTransport(token).serve(system)
        try:
            builder = await listener.node.spawn(
                f"{ClusterBuilder.__module__}:ClusterBuilder", spec, name="cluster"
            )
            await builder.join(listener.node, "in the test process")
            info: ClusterInfo = await builder.cluster()
            yield listener.address, info, system
        finally:
            await listener.aclose()
