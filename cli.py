"""The ``atoll`` command line.

Subcommands: ``demo`` runs the main demo on an in-process cluster; ``run``
runs an example; ``bench NAME`` runs a benchmark; ``up``, ``host`` and
``node`` start processes of a Cap'n Proto cluster; ``version`` prints the
version.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Sequence

import anyio

from .examples import EXAMPLES

__all__ = ["main"]


class _WithDefaults(argparse.HelpFormatter):
    """Help that shows each option's default, unless its text says it already
    (or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default is not None and action.default is not False
        if not shown or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


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
    demo.add_argument("--timeline", metavar="JSON", help="write the run's timeline (Chrome trace)")
    demo.add_argument(
        "--timeline-page", metavar="HTML", help="and a page that draws it (--timeline)"
    )
    demo.add_argument("--elements", type=_positive, default=8, help="size of the array that moves")
    bench = sub.add_parser("bench", help="run a benchmark (args after the name go to it)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER)
    node = sub.add_parser("node", help="serve one node over Cap'n Proto (token: ATOLL_TOKEN)")
    node.add_argument("--listen", default="capnp://127.0.0.1:0")
    node.add_argument("--login-timeout", type=float, default=10.0)
    node.add_argument("--cluster-file", help="write address and token here, for atoll.connect")
    up = sub.add_parser(
        "up",
        help="start a controller and host processes on this machine",
        formatter_class=_WithDefaults,
    )
    up.add_argument(
        "--hosts",
        type=int,
        default=2,
        help="host processes started here (0: every host joins from elsewhere)",
    )
    up.add_argument(
        "--remote-hosts",
        type=int,
        default=0,
        help="more hosts expected to join from elsewhere (atoll host --join)",
    )
    up.add_argument(
        "--islands",
        type=_positive,
        default=1,
        help="islands the hosts split into evenly; each has its own scheduler and gang order",
    )
    up.add_argument(
        "--spares",
        type=int,
        default=0,
        help="hosts per island kept out of allocation, for slices that must leave a host",
    )
    up.add_argument("--devices-per-host", type=_positive, default=4, help="devices on each host")
    up.add_argument(
        "--device",
        choices=["sim", "jax"],
        default="sim",
        help="sim: simulated devices (a cost model's device time); jax: JAX's devices",
    )
    up.add_argument("--port", type=int, default=0, help="controller port (0: any free one)")
    up.add_argument("--host", default="127.0.0.1", help="address to listen on")
    up.add_argument(
        "--scheduler",
        default="share",  # schedulers.DEFAULT_POLICY
        help="every island's policy, by name: share, fifo, or a plugin's (docs/schedulers.md)",
    )
    up.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="serve the dashboard and /metrics (Prometheus) here from the start "
        "(the dashboard extra; default: only on `atoll dashboard`)",
    )
    up.add_argument(
        "--store-bytes",
        type=_positive,
        help="each host's object store holds at most this many bytes (default: no limit)",
    )
    up.add_argument(
        "--cluster-file",
        help="write address and token here (default: $XDG_RUNTIME_DIR/atoll/cluster.json, "
        "else ~/.atoll/cluster.json, in a directory of mode 0700)",
    )
    up.add_argument(
        "--jax-coordinator",
        metavar="HOST:PORT",
        help="where the first host serves the hosts' JAX runtime (--device jax; "
        "default: a free port on --host), for --remote-hosts to join",
    )
    config = sub.add_parser(
        "config", help="the settings in force here, or in a running cluster (docs/configuration.md)"
    )
    config.add_argument(
        "--cluster", action="store_true", help="a running cluster's settings, not this process's"
    )
    config.add_argument(
        "--cluster-file", help="that cluster (default: the one atoll up started last)"
    )
    config.add_argument("--json", action="store_true", help="print the rows as JSON")
    config.add_argument(
        "--markdown", action="store_true", help="print docs/configuration.md (every setting)"
    )
    status = sub.add_parser("status", help="hosts, islands and sessions of a running cluster")
    status.add_argument("--cluster-file", help="default: the cluster atoll up started last here")
    status.add_argument("--json", action="store_true", help="print the rows as JSON")
    timeline = sub.add_parser("timeline", help="record a running cluster's timeline (Chrome trace)")
    timeline.add_argument("--cluster-file", help="default: the cluster atoll up started last here")
    timeline.add_argument("-o", "--output", default="timeline.json", help="where to write it")
    timeline.add_argument(
        "--seconds", type=float, help="how long to record (default: until Ctrl-C)"
    )
    dashboard = sub.add_parser("dashboard", help="serve a cluster's web page from its controller")
    dashboard.add_argument("--cluster-file", help="default: the cluster atoll up started last here")
    dashboard.add_argument("--port", type=int, default=0, help="0: any free one")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to listen on")
    top = sub.add_parser("top", help="a running cluster, live: devices, sessions, rates")
    top.add_argument("--cluster-file", help="default: the cluster atoll up started last here")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="draw one frame and exit")
    drain = sub.add_parser(
        "drain", help="move every slice and buffer off a host; the host then leaves"
    )
    drain.add_argument("--host", type=int, required=True, help="the host id (atoll status)")
    drain.add_argument("--cluster-file", help="default: the cluster atoll up started last here")
    drain.add_argument("--timeout", type=float, default=600.0, help="seconds")
    down = sub.add_parser("down", help="stop a cluster started by atoll up, hosts and all")
    down.add_argument("--cluster-file", help="default: the cluster atoll up started last here")
    host = sub.add_parser("host", help="join a host to a running cluster")
    host.add_argument("--join", required=True, help="controller address, capnp://HOST:PORT")
    host.add_argument(
        "--cluster-file", help="take the token from this file (the one atoll up printed)"
    )
    host.add_argument(
        "--listen",
        default="capnp://127.0.0.1:0",
        help="where this host serves its buffers to other hosts",
    )
    host.add_argument(
        "--jax-coordinator",
        metavar="HOST:PORT",
        help="join the hosts' JAX runtime there (as atoll up --device jax printed)",
    )
    host.add_argument("--jax-process-id", type=int, help="this host's JAX process id")
    host.add_argument("--jax-processes", type=_positive, help="how many hosts join it")
    run = sub.add_parser("run", help="run an example (each is checked against plain JAX)")
    run.add_argument("example", choices=EXAMPLES)
    run.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    run.add_argument(
        "options", nargs=argparse.REMAINDER, help="the example's own (atoll run train_lm --help)"
    )
    from .partition.cli import add_commands as add_partition_commands

    add_partition_commands(sub)
    sub.add_parser("version", help="print the version")
    return parser


def _run(args: argparse.Namespace) -> int:
    from .examples import run_example

    backend, options = _backend_of(args.backend, list(args.options))
    return run_example(args.example, backend, options)


def _backend_of(backend: str, options: list[str]) -> tuple[str, list[str]]:
    """``--backend`` given after the example's name is atoll's, not the
    example's: take it out of the example's options."""
    for i, option in enumerate(options):
        if option.startswith("--backend="):
            return _checked_backend(option.partition("=")[2]), options[:i] + options[i + 1 :]
        if option == "--backend" and i + 1 < len(options):
            return _checked_backend(options[i + 1]), options[:i] + options[i + 2 :]
    return backend, options


def _checked_backend(name: str) -> str:
    if name not in ("asyncio", "trio"):
        raise SystemExit(f"atoll run: --backend must be asyncio or trio, not {name!r}")
    return name


def _up(args: argparse.Namespace) -> int:
    import asyncio

    from .devices import Device, SimDevice
    from .kernel import AtollError
    from .runtime.deploy.process import run_up
    from .runtime.deploy.spec import ClusterSpec
    from .transports.capnp.clusterfile import default_cluster_file

    if args.hosts < 0 or args.remote_hosts < 0 or args.hosts + args.remote_hosts < 1:
        raise SystemExit("atoll up: needs at least one host (--hosts, --remote-hosts)")
    device_cls: type[Device] = SimDevice
    if args.device == "jax":
        from .devices.jax.device import JaxDevice

        device_cls = JaxDevice
    spec = ClusterSpec.of_hosts(
        args.hosts + args.remote_hosts,
        args.islands,
        devices_per_host=args.devices_per_host,
        scheduler=args.scheduler,
        device_cls=device_cls,
        remote_hosts=args.remote_hosts,
        store_bytes=args.store_bytes,
        spares=args.spares,
    )
    if args.device == "jax" and args.remote_hosts:
        _share_jax_runtime(args)
    try:
        cluster_file = args.cluster_file or str(default_cluster_file())
    except AtollError as exc:
        raise SystemExit(f"atoll up: {exc}") from None
    http = _http_address(args.http, args.host) if args.http else None
    asyncio.run(run_up(spec, f"capnp://{args.host}:{args.port}", cluster_file, http=http))
    return 0


def _http_address(given: str, default_host: str) -> tuple[str, int]:
    """``--http [HOST:]PORT`` as (host, port); a clear exit if it is not one."""
    host, _, port = given.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise SystemExit(f"atoll up: --http wants [HOST:]PORT, not {given!r}")
    return host or default_host, int(port)


def _share_jax_runtime(args: argparse.Namespace) -> None:
    """``up --device jax --remote-hosts N``: one JAX runtime for local and remote hosts.

    The launcher's environment carries it to the hosts it starts (JAX
    process ids 0 to ``--hosts`` - 1); remote hosts are told how to join.
    Its coordination service runs in the launcher, unless
    ``--jax-coordinator`` names where it runs (JAX process 0 then serves it).
    """
    import os

    from .devices.jax.multi import COORDINATOR, PROCESSES

    total = args.hosts + args.remote_hosts
    if args.jax_coordinator:
        os.environ[COORDINATOR] = args.jax_coordinator
    os.environ[PROCESSES] = str(total)
    where = args.jax_coordinator or "served by the controller"
    print(
        f"atoll: remote hosts get the JAX runtime ({where}, "
        f"{total} processes) from the controller when they join",
        flush=True,
    )


def _status(args: argparse.Namespace) -> int:
    """``atoll status``: tables on a terminal (rich), rows as JSON with ``--json``."""
    import asyncio
    import json

    from .kernel import AtollError
    from .runtime.tools.admin import status_rows
    from .runtime.tools.status import render

    try:
        rows = asyncio.run(status_rows(args.cluster_file))
    except AtollError as exc:
        raise SystemExit(f"atoll status: {exc}") from None
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)  # a pipe: wide, no wrap
    for table in render(rows):
        console.print(table)
    return 0


def _config(args: argparse.Namespace) -> int:
    """``atoll config``: each setting, its value here (or in the cluster
    with ``--cluster``), its default, its scope and what it sets."""
    import asyncio
    import json

    from .kernel import AtollError
    from .kernel.config import markdown, settings
    from .runtime.tools.admin import config_rows

    if args.markdown:
        print(markdown(), end="")
        return 0
    try:
        if args.cluster or args.cluster_file:
            rows = asyncio.run(config_rows(args.cluster_file))
        else:
            rows = settings().rows()
    except AtollError as exc:
        raise SystemExit(f"atoll config: {exc}") from None
    keys = ("variable", "value", "default", "scope", "doc")
    if args.json:
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("variable", "value", "default", "scope", "what it sets", title="atoll settings")
    for env, value, default, scope, doc in rows:
        shown = value if value == default else f"[bold]{value}[/bold]"
        table.add_row(env, shown or "-", default or "-", scope, doc)
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def _timeline(args: argparse.Namespace) -> int:
    import asyncio

    from .kernel import AtollError
    from .runtime.tools.admin import record_timeline

    try:
        print(asyncio.run(record_timeline(args.cluster_file, args.output, args.seconds)))
    except AtollError as exc:
        raise SystemExit(f"atoll timeline: {exc}") from None
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    import asyncio

    from .kernel import AtollError
    from .runtime.tools.admin import open_dashboard

    try:
        url = asyncio.run(open_dashboard(args.cluster_file, args.host, args.port))
    except AtollError as exc:
        raise SystemExit(f"atoll dashboard: {exc}") from None
    print(f"atoll dashboard at {url}  (served by the controller until it stops)", flush=True)
    return 0


def _top(args: argparse.Namespace) -> int:
    """``atoll top``: a live view until Ctrl-C (``--once``: one frame)."""
    import asyncio
    import contextlib

    from .kernel import AtollError
    from .runtime.tools.top import top

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(top(args.cluster_file, args.interval, args.once))
    except AtollError as exc:
        raise SystemExit(f"atoll top: {exc}") from None
    return 0


def _drain(args: argparse.Namespace) -> int:
    """``atoll drain --host H``: the controller moves everything off host H."""
    import asyncio

    from .kernel import AtollError
    from .runtime.tools.admin import drain_host

    try:
        print(asyncio.run(drain_host(args.cluster_file, args.host, args.timeout)), flush=True)
    except (AtollError, OSError, TimeoutError) as exc:
        raise SystemExit(f"atoll drain: {exc}") from None
    return 0


def _down(args: argparse.Namespace) -> int:
    import asyncio

    from .kernel import AtollError
    from .runtime.tools.admin import shut_down

    try:
        print(asyncio.run(shut_down(args.cluster_file)), flush=True)
    except AtollError as exc:
        raise SystemExit(f"atoll down: {exc}") from None
    return 0


def _host(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from .kernel import AtollError, logs
    from .runtime.deploy.process import run_host
    from .transports.capnp import ClusterFile, default_token

    token = ClusterFile.read(args.cluster_file).token if args.cluster_file else default_token()
    if args.jax_coordinator:
        _join_jax_runtime(args)
    # a host started by `atoll up` shares its terminal; one from elsewhere
    # also sends its log to the controller's
    from .kernel.config import launched

    forward = launched("parent_pid") is None
    logs.set_prefix(f"host (pid {os.getpid()}) | ")
    logs.filter_native_stdout()  # Gloo's connection lines, unless ATOLL_LOG=debug
    try:
        asyncio.run(run_host(args.join, token, args.listen, forward_logs=forward))
    except AtollError as exc:  # e.g. "login ... refused: wrong cluster token"
        raise SystemExit(f"atoll host: {exc}") from None
    return 0


def _join_jax_runtime(args: argparse.Namespace) -> None:
    """``host --jax-coordinator``: this host's JAX devices join the others' runtime."""
    import os

    from .devices.jax.multi import COORDINATOR, LOCAL, PROCESS_ID, PROCESSES

    if args.jax_process_id is None or args.jax_processes is None:
        raise SystemExit("atoll host: --jax-coordinator needs --jax-process-id and --jax-processes")
    os.environ.update(
        {
            COORDINATOR: args.jax_coordinator,
            PROCESSES: str(args.jax_processes),
            PROCESS_ID: str(args.jax_process_id),
            LOCAL: "1",  # its atoll devices take its own JAX devices
        }
    )


BENCHMARKS = {
    "accelerator": "atoll.benchmarks.accelerator",
    "transport": "atoll.benchmarks.transport",
    "dispatch": "atoll.benchmarks.dispatch",
    "scale": "atoll.benchmarks.scale",
    "partition": "atoll.benchmarks.partition",
    "peers": "atoll.benchmarks.peers",
    "handoff": "atoll.benchmarks.handoff",
    "bridge": "atoll.benchmarks.bridge",
    "multitenant": "atoll.benchmarks.multitenant",
    "faults": "atoll.benchmarks.faults",
    "load": "atoll.benchmarks.load",
    "train": "atoll.benchmarks.train",
    "elastic": "atoll.benchmarks.elastic",
    "controlplane": "atoll.benchmarks.controlplane",
}


def _bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/NAME.py``'s ``main``: benchmarks live in the source tree only."""
    try:
        importlib.import_module("atoll.benchmarks")
    except ModuleNotFoundError as exc:
        if exc.name not in ("atoll.benchmarks", "atoll"):
            raise
        raise SystemExit(
            "atoll bench: the benchmarks are not part of the installed package; "
            "run them from a source checkout (pip install -e . in a clone of atoll)"
        ) from None
    module = importlib.import_module(BENCHMARKS[args.name])
    common = importlib.import_module("atoll.benchmarks._common")
    with common.progress_bars():  # rich bars on a terminal, for every timed job
        code: int = module.main(args.args)
    return code


def _node(args: argparse.Namespace) -> int:
    from .transports.capnp._process import main as node_main

    argv = ["--listen", args.listen, "--login-timeout", str(args.login_timeout)]
    if args.cluster_file:
        argv += ["--cluster-file", args.cluster_file]
    return node_main(argv)


def _demo(args: argparse.Namespace) -> int:
    from .examples.demo import format_demo, run_demo

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
        timeline=args.timeline,
        elements=args.elements,
    )
    result = anyio.run(job, backend=args.backend)
    print(format_demo(result, args.step_ms))
    if args.timeline:
        print(f"timeline written to {args.timeline} (open it in https://ui.perfetto.dev)")
    if args.timeline and args.timeline_page:
        import json
        from pathlib import Path

        from .runtime.tools.dashboard import timeline_page

        document = json.loads(Path(args.timeline).read_text())
        title = f"atoll demo: a chain of {args.steps} steps"
        Path(args.timeline_page).write_text(timeline_page(document, title))
        print(f"page that draws it written to {args.timeline_page}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``atoll`` console script."""
    args = _parser().parse_args(argv)
    from .kernel import logs
    from .kernel.config import BadSetting, settings

    try:
        settings()  # read once, at start: a bad ATOLL_* value is said here
    except BadSetting as exc:
        raise SystemExit(f"atoll: {exc} (docs/configuration.md)") from None
    logs.configure()  # ATOLL_LOG=debug|info|warning; each line names its actor
    logs.quiet_native_logs()  # XLA's C++ warnings only with ATOLL_LOG=info or debug
    try:
        return _command(args)
    except ModuleNotFoundError as exc:  # an optional extra is missing: say which
        from .kernel.extras import explain

        missing = explain(exc, f"atoll {args.command}")
        if missing is None:
            raise
        raise SystemExit(f"atoll: {missing}") from None


def _command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "node":
        return _node(args)
    if args.command == "up":
        return _up(args)
    if args.command == "run":
        return _run(args)
    from .partition.cli import COMMANDS as PARTITION_COMMANDS
    from .partition.cli import run as run_partition

    if args.command in PARTITION_COMMANDS:
        return run_partition(args)
    if args.command == "host":
        return _host(args)
    if args.command == "status":
        return _status(args)
    if args.command == "config":
        return _config(args)
    if args.command == "down":
        return _down(args)
    if args.command == "drain":
        return _drain(args)
    if args.command == "timeline":
        return _timeline(args)
    if args.command == "top":
        return _top(args)
    if args.command == "dashboard":
        return _dashboard(args)
    from . import __version__

    print(__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
