"""Every setting of atoll in one typed object, read once, at start.

:class:`Settings` holds each setting as a field: its type, its default, the
``ATOLL_*`` environment variable that overrides it and a one-line doc (the
field's metadata, a :class:`Setting`). ``docs/configuration.md`` is
generated from it (``atoll config --markdown``) and a test keeps the
two equal; ``atoll config`` shows the settings in force, here or in a
running cluster.

A process reads its environment once, when :func:`settings` is first asked
(never at import), and keeps that object. Three scopes:

* ``cluster``: the dispatch path's switches and sizes. The controller's
  settings are sent to every host process when it joins (``ClusterSpec``
  carries them; ``Host`` puts them in force with :func:`use`), so a host
  never runs the path with other switches than its controller's, wherever
  it was started.
* ``process``: what each process decides for itself (its log level, its
  relay, who its machine is, a client's batching).
* ``launcher``: what atoll's launchers set for the processes they start
  (the cluster token, the JAX runtime's coordinates). They are declared
  here like the others, but read where they are used, at that moment
  (:func:`launched`): a launcher may set them in its own environment for
  itself and its children after it started.

Nothing here is asynchronous.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from ._errors import AtollError

__all__ = [
    "BadSetting",
    "Setting",
    "Settings",
    "env_name",
    "launched",
    "markdown",
    "overridden",
    "reset",
    "settings",
    "use",
]

Scope = str  # "cluster", "process" or "launcher"


class BadSetting(AtollError, ValueError):
    """An ``ATOLL_*`` variable whose value does not parse; names it."""


@dataclass(frozen=True)
class Setting:
    """What the configuration knows about one field: its variable, its
    one-line doc, its scope and how its text parses."""

    env: str
    doc: str
    scope: Scope
    parse: Callable[[str], Any]
    secret: bool = False


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1 or 0")


def _whole(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError("expected a whole number, 0 or more")
    return value


def _positive_whole(text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError("expected a whole number above 0")
    return value


def _seconds(text: str) -> float:
    value = float(text.strip())
    if not value >= 0:
        raise ValueError("expected seconds, 0 or more")
    return value


def _pair(text: str) -> tuple[float, float]:
    every, comma, timeout = text.partition(",")
    if not comma:
        raise ValueError("expected EVERY,TIMEOUT in seconds")
    pair = (_seconds(every), _seconds(timeout))
    if not pair[0] > 0 or not pair[1] > 0:
        raise ValueError("both must be above 0")
    return pair


def _level(text: str) -> str:
    name = text.strip().lower()
    if name in ("debug", "info", "warning", "error"):
        return name
    raise ValueError("expected a level: debug, info, warning or error")


def _text(text: str) -> str:
    return text.strip()


def _optional_whole(text: str) -> int | None:
    return _whole(text) if text.strip() else None


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return "" if value is None else str(value)


def _setting(
    default: Any,
    env: str,
    doc: str,
    parse: Callable[[str], Any],
    scope: Scope = "cluster",
    secret: bool = False,
) -> Any:
    meta = Setting(env, doc, scope, parse, secret)
    return field(default=default, metadata={"setting": meta})


MIB = 1 << 20


@dataclass(frozen=True)
class Settings:
    """Every setting, with its default; ``Settings.from_env()`` reads the
    environment's overrides. Frozen: change one with :meth:`replace`."""

    # -- the dispatch path (cluster) -------------------------------------------
    run_lanes: bool = _setting(
        True,
        "ATOLL_RUN_LANES",
        "runs go one way on lanes (plain TCP links) between clients, controller and "
        "host processes; 0: by Cap'n Proto calls only (A/B runs)",
        _flag,
    )
    leases: bool = _setting(
        True,
        "ATOLL_LEASES",
        "a session's runs of one device go straight to the device's host, under a lease "
        "from the controller (several sessions' may share a device under the share "
        "policy); 0: every run through the controller (A/B runs)",
        _flag,
    )
    push_lanes: bool = _setting(
        True,
        "ATOLL_PUSH_LANES",
        "small outputs a producer pushes to a reader's host go on its lane; 0: every "
        "push by Cap'n Proto call (A/B runs)",
        _flag,
    )
    fuse: bool = _setting(
        True,
        "ATOLL_FUSE",
        "a JAX device compiles runs of consecutive gangs into one executable; 0: each "
        "gang on its own (A/B runs)",
        _flag,
    )
    shm: bool = _setting(
        True,
        "ATOLL_SHM",
        "processes of one machine share large arrays through /dev/shm segments; 0: "
        "every array by stream",
        _flag,
    )
    shm_spare_bytes: int = _setting(
        256 * MIB,
        "ATOLL_SHM_SPARE_BYTES",
        "bytes of freed shared-memory segments a process keeps for reuse (two per size)",
        _whole,
    )
    shm_keep_bytes: int = _setting(
        512 * MIB,
        "ATOLL_SHM_KEEP_BYTES",
        "bytes of other processes' segments a reader keeps mapped for reuse",
        _whole,
    )
    store_wait_s: float = _setting(
        60.0,
        "ATOLL_STORE_WAIT_S",
        "how long work waits for room in a full bounded store before StoreFull",
        _seconds,
    )
    lane_ack_s: float = _setting(
        0.005,
        "ATOLL_LANE_ACK_S",
        "a data lane's receiver acknowledges frames this long after the first it counts",
        _seconds,
    )
    jax_heartbeat_s: int = _setting(
        100,
        "ATOLL_JAX_HEARTBEAT_S",
        "seconds of missed heartbeats before JAX's coordination service declares a process lost",
        _positive_whole,
    )
    jax_collective_timeout_s: int = _setting(
        60,
        "ATOLL_JAX_COLLECTIVE_TIMEOUT_S",
        "seconds a CPU collective waits for its peers before it fails",
        _positive_whole,
    )
    # -- each process its own ----------------------------------------------------
    log: str = _setting(
        "",
        "ATOLL_LOG",
        "level of atoll's log and of the libraries under it (debug, info, warning, "
        "error); unset: warnings and above",
        _level,
        "process",
    )
    batch_runs: bool = _setting(
        True,
        "ATOLL_BATCH_RUNS",
        "a client joins the runs of one loop turn into one message; 0: each run on "
        "its own (A/B runs)",
        _flag,
        "process",
    )
    connection_calls: int | None = _setting(
        None,
        "ATOLL_CONNECTION_CALLS",
        "calls one Cap'n Proto connection may have in flight before MailboxFull (0: "
        "no bound); unset: the transport's default (docs/transport.md)",
        _optional_whole,
        "process",
    )
    host_heartbeat: tuple[float, float] = _setting(
        (2.0, 8.0),
        "ATOLL_HOST_HEARTBEAT",
        "EVERY,TIMEOUT: how often the controller pings each host, and how long it "
        "waits for the answer before the host is lost",
        _pair,
        "process",
    )
    drain_grace_s: float = _setting(
        20.0,
        "ATOLL_DRAIN_GRACE_S",
        "how long a host asked to stop (SIGTERM, a preemption) has to drain its slices first",
        _seconds,
        "process",
    )
    machine_id: str = _setting(
        "",
        "ATOLL_MACHINE_ID",
        "who this machine is, for shared memory (unset: boot id and host name; "
        "per-process: every process a machine of its own, as tests do)",
        _text,
        "process",
    )
    bulk_relay: str = _setting(
        "",
        "ATOLL_BULK_RELAY",
        "HOST:PORT of a relay this process reads bulk arrays through (fault tests)",
        _text,
        "process",
    )
    # -- set by atoll's launchers for the processes they start --------------------
    token: str = _setting(
        "",
        "ATOLL_TOKEN",
        "the cluster token, in hex (a launcher passes it to the processes it starts; "
        "else a fresh one, or the cluster file's)",
        _text,
        "launcher",
        secret=True,
    )
    parent_pid: int | None = _setting(
        None,
        "ATOLL_PARENT_PID",
        "the launcher that started this host process: its log goes there, and the "
        "host ends with it",
        _optional_whole,
        "launcher",
    )
    jax_coordinator: str = _setting(
        "",
        "ATOLL_JAX_COORDINATOR",
        "HOST:PORT of the JAX runtime's coordination service",
        _text,
        "launcher",
    )
    jax_processes: int | None = _setting(
        None,
        "ATOLL_JAX_PROCESSES",
        "how many processes the JAX runtime has",
        _optional_whole,
        "launcher",
    )
    jax_process_id: int | None = _setting(
        None,
        "ATOLL_JAX_PROCESS_ID",
        "this process's id in the JAX runtime",
        _optional_whole,
        "launcher",
    )
    jax_local: bool = _setting(
        False,
        "ATOLL_JAX_LOCAL",
        "1: this host process's atoll devices take its own JAX devices",
        _flag,
        "launcher",
    )
    jax_service: str = _setting(
        "",
        "ATOLL_JAX_SERVICE",
        "launcher: the launcher serves the JAX coordination service (process 0 does not)",
        _text,
        "launcher",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The defaults, overridden by what ``environ`` (``os.environ``) sets;
        raises :class:`BadSetting` naming a variable whose value does not parse."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, meta in _settings():
            text = environ.get(meta.env)
            if text is None or (not text.strip() and meta.parse is not _text):
                continue
            try:
                values[name] = meta.parse(text)
            except ValueError as exc:
                raise BadSetting(f"{meta.env}={text!r}: {exc}") from None
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (by field name)."""
        return dataclasses.replace(self, **changes)

    def cluster(self) -> dict[str, Any]:
        """The cluster-scoped fields and their values (what hosts take from
        their controller)."""
        return {name: getattr(self, name) for name, meta in _settings() if meta.scope == "cluster"}

    def with_cluster(self, cluster: Mapping[str, Any]) -> Settings:
        """These settings with the cluster-scoped fields of ``cluster``."""
        known = {name for name, meta in _settings() if meta.scope == "cluster"}
        return self.replace(**{k: v for k, v in cluster.items() if k in known})

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process these settings (those not
        at their default; launcher fields are the launcher's to set)."""
        default = Settings()
        return {
            meta.env: _show(getattr(self, name))
            for name, meta in _settings()
            if meta.scope != "launcher" and getattr(self, name) != getattr(default, name)
        }

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(variable, value, default, scope, doc) per setting, secrets hidden."""
        default = Settings()
        out = []
        for name, meta in _settings():
            value = _show(getattr(self, name))
            if meta.secret and value:
                value = "(set)"
            out.append((meta.env, value, _show(getattr(default, name)), meta.scope, meta.doc))
        return out


def _settings() -> Iterator[tuple[str, Setting]]:
    for each in fields(Settings):
        yield each.name, each.metadata["setting"]


_in_force: list[Settings] = []  # this process's settings, once read


def settings() -> Settings:
    """The settings in force in this process: read from the environment
    the first time they are asked for, then kept (see :func:`use`)."""
    if not _in_force:
        _in_force.append(Settings.from_env())
    return _in_force[0]


def use(new: Settings) -> Settings:
    """Put ``new`` in force in this process (a host told by its controller,
    a test); returns the settings it replaced."""
    old = settings()
    _in_force[0] = new
    return old


def reset() -> None:
    """Forget the settings in force: the next :func:`settings` reads the
    environment again (for tests, which change it between cases)."""
    _in_force.clear()


@contextmanager
def overridden(**changes: Any) -> Iterator[Settings]:
    """Within the block, these settings with ``changes`` (tests, A/B runs)."""
    old = use(settings().replace(**changes))
    try:
        yield settings()
    finally:
        use(old)


def launched(name: str) -> Any:
    """The launcher-set field ``name`` as this process's environment holds
    it now (launchers set these for themselves as well as their children)."""
    meta = next(m for n, m in _settings() if n == name)
    text = os.environ.get(meta.env, "")
    if not text.strip():
        return getattr(Settings(), name)
    try:
        return meta.parse(text)
    except ValueError as exc:
        raise BadSetting(f"{meta.env}={text!r}: {exc}") from None


def env_name(name: str) -> str:
    """The variable of field ``name``."""
    return next(m.env for n, m in _settings() if n == name)


def markdown() -> str:
    """``docs/configuration.md``, generated from :class:`Settings`."""
    head = [
        "# Configuration",
        "",
        "<!-- generated by `atoll config --markdown`; a test checks it -->",
        "",
        "Every setting of atoll is a field of `atoll.kernel.config.Settings`,",
        "overridden by its environment variable. A process reads them once, when",
        "they are first asked for (never at import). `atoll config` shows the",
        "settings in force in this process, and `atoll config --cluster-file FILE`",
        "the settings of a running cluster's controller.",
        "",
        "Scopes: **cluster** settings are the controller's, and every host process",
        "takes them from it when it joins, wherever it was started; **process**",
        "settings are each process's own; **launcher** settings are set by atoll's",
        "launchers for the processes they start.",
        "",
        "| variable | default | scope | what it sets |",
        "|---|---|---|---|",
    ]
    rows = [
        f"| `{env}` | {f'`{default}`' if default else '(unset)'} | {scope} | {doc} |"
        for env, _, default, scope, doc in Settings().rows()
    ]
    tail = [
        "",
        "Variables that are not atoll's settings: the SLURM template in",
        "`docs/deploy.md` reads `ATOLL_PORT`, `ATOLL_DEVICE`, `ATOLL_DEVICES_PER_HOST`",
        "and `ATOLL_PROGRAM` (its own shell variables); `./dev` reads",
        "`ATOLL_INSTALL_BROWSER` and `ATOLL_INSTALL_PROMETHEUS`; the tests read",
        "`ATOLL_STOP_RUNS` (`tests/runtime/test_reliability.py`) and `ATOLL_FUZZ_EXAMPLES`",
        "(`tests/transports/test_security.py`).",
        "",
    ]
    return "\n".join([*head, *rows, *tail])
