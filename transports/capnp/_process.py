"""A node process: an actor system served over Cap'n Proto until told to stop.

``python -m atoll.transports.capnp.node --listen capnp://127.0.0.1:0`` starts
one. It reads the cluster token from ``ATOLL_TOKEN`` (hex), prints one line,
``ATOLL-NODE <address>``, once it accepts connections, and exits cleanly on
SIGTERM or SIGINT (connections closed, actors stopped). ``atoll node`` runs
one; tests start them through :class:`atoll.transports.testing.NodeProcess`,
and peers reach them with :class:`CapnpTransport.connect`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from ...kernel import ActorSystem
from ._transport import CapnpTransport, capnp_runtime, default_token
from .clusterfile import ClusterFile

__all__ = ["READY_PREFIX", "main", "serve_node", "stop_on_signals"]

READY_PREFIX = "ATOLL-NODE "


def stop_on_signals() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT (this process's asyncio loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def serve_node(
    address: str, token: bytes, login_timeout: float = 10.0, cluster_file: str | None = None
) -> None:
    """Serve a fresh actor system at ``address`` until SIGTERM/SIGINT.

    With ``cluster_file``, also write the address and token there (mode 0600)
    for ``atoll.connect``.
    """
    stop = stop_on_signals()
    transport = CapnpTransport(token, login_timeout=login_timeout)
    async with capnp_runtime(), ActorSystem("node") as system:
        listener = await transport.serve(system, address)
        if cluster_file:
            ClusterFile(listener.address, token).write(cluster_file)
        print(f"{READY_PREFIX}{listener.address}", flush=True)
        try:
            await stop.wait()
        finally:
            await listener.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atoll-node", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="capnp://127.0.0.1:0")
    parser.add_argument("--login-timeout", type=float, default=10.0)
    parser.add_argument("--cluster-file", help="write address and token here (mode 0600)")
    args = parser.parse_args(argv)
    asyncio.run(serve_node(args.listen, default_token(), args.login_timeout, args.cluster_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
