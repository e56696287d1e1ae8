"""The ``atoll`` command line.

Subcommands: ``demo`` runs the main demo on an in-process cluster; ``bench
NAME`` runs a benchmark; ``node`` serves one node over Cap'n Proto;
``version`` prints the version.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Sequence

import anyio

__all__ = ["main"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atoll", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a chained dataflow on an in-process cluster")
    demo.add_argument("--islands", type=_positive, default=2)
    demo.add_argument("--hosts-per-island", type=_positive, default=2)
    demo.add_argument("--devices-per-host", type=_positive, default=2)
    demo.add_argument("--steps", type=_positive, default=16)
    demo.add_argument("--step-ms", type=float, default=2.0, help="device time per step")
    demo.add_argument("--virtual-clock", action="store_true", help="simulate time, no sleeping")
    demo.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    bench = sub.add_parser("bench", help="run a benchmark (args after the name go to it)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER)
    node = sub.add_parser("node", help="serve one node over Cap'n Proto (token: ATOLL_TOKEN)")
    node.add_argument("--listen", default="capnp://127.0.0.1:0")
    node.add_argument("--login-timeout", type=float, default=10.0)
    sub.add_parser("version", help="print the version")
    return parser


BENCHMARKS = {"transport": "atoll.transports.capnp.bench"}


def _bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.name])
    code: int = module.main(args.args)
    return code


def _node(args: argparse.Namespace) -> int:
    from .transports.capnp._process import main as node_main

    return node_main(["--listen", args.listen, "--login-timeout", str(args.login_timeout)])


def _demo(args: argparse.Namespace) -> int:
    from .demo import format_demo, run_demo

    if args.step_ms < 0:
        raise SystemExit("atoll demo: --step-ms must not be negative")
    job = functools.partial(
        run_demo,
        args.islands,
        args.hosts_per_island,
        args.devices_per_host,
        args.steps,
        args.step_ms,
        virtual=args.virtual_clock,
    )
    result = anyio.run(job, backend=args.backend)
    print(format_demo(result, args.step_ms))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``atoll`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "node":
        return _node(args)
    from . import __version__

    print(__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
