"""One JAX runtime across host processes, for gangs whose devices span hosts.

In a cluster of host processes (``atoll up --device jax``, ``process_cluster``)
every host process joins one ``jax.distributed`` runtime when its first
:class:`~atoll.devices.jax.JaxDevice` starts. CPU collectives then go
over gloo (TCP), GPU ones over NCCL, and every process sees the *global*
device list. A gang over devices of several hosts runs as ONE SPMD
computation: on each host, the gang's first device there (its *host leader*)
calls the same compiled program over the global mesh with that host's shards,
in the same order everywhere, which is what island gang scheduling guarantees.

The launcher passes the runtime's parameters through the environment:

* ``ATOLL_JAX_COORDINATOR``: ``host:port`` of the coordination service. The
  launcher serves it itself (:func:`serve_coordination`, and
  ``ATOLL_JAX_SERVICE=launcher`` tells the hosts so), so that no host's loss
  takes it down; when a coordinator is named instead (``--jax-coordinator``),
  JAX process 0 serves it, as ``jax.distributed`` does by default;
* ``ATOLL_JAX_PROCESSES``: how many host processes join;
* ``ATOLL_JAX_PROCESS_ID``: this process's JAX process id (the launcher's start
  order, not the atoll host id: the builder numbers hosts as they join).

A lost host process does not take the others down (``docs/reliability.md``,
"A lost JAX host"): every process turns on JAX's recoverability, so the
coordination service no longer terminates the survivors when it misses the
lost one's heartbeats (after ``ATOLL_JAX_HEARTBEAT_S``, 100 s by default),
and a collective with a dead peer gives up after
``ATOLL_JAX_COLLECTIVE_TIMEOUT_S`` (60 s by default; CPU collectives).

Because JAX process ids and atoll host ids differ, each device publishes which
JAX device it owns in the runtime's key-value store (``atoll/jax-device/D``),
and a gang's devices are looked up there (:func:`resolve`).

JAX is imported inside the functions: the launcher imports this module to
build the environment and must stay light when it runs simulated devices.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...kernel.config import env_name, launched, settings
from .._errors import DeviceError

if TYPE_CHECKING:
    import jax

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "COORDINATOR",
    "HEARTBEAT",
    "LOCAL",
    "PROCESSES",
    "PROCESS_ID",
    "SERVICE",
    "collective_timeout_s",
    "coordinator_env",
    "ensure_runtime",
    "free_port",
    "heartbeat_timeout_s",
    "host_leader",
    "jax_device",
    "local_copy",
    "local_devices_only",
    "register",
    "resolve",
    "resolve_now",
    "serve_coordination",
    "spans_processes",
]

# the variables, as kernel/config.py declares them
COORDINATOR = env_name("jax_coordinator")
PROCESSES = env_name("jax_processes")
PROCESS_ID = env_name("jax_process_id")
LOCAL = env_name("jax_local")  # "1": a host process's atoll devices take its own JAX devices
SERVICE = env_name("jax_service")  # "launcher": the launcher serves the coordination service
HEARTBEAT = env_name("jax_heartbeat_s")  # see heartbeat_timeout_s
COLLECTIVE_TIMEOUT = env_name("jax_collective_timeout_s")  # see collective_timeout_s

_KEY = "atoll/jax-device/{}"
_LOOKUP_TIMEOUT_MS = 120_000  # a device publishes once its runtime is up
_INIT_TIMEOUT_S = 300  # every host process must join within this
_SHUTDOWN_TIMEOUT_S = 30
_COLLECTIVE_FLAG = "xla_cpu_collective_timeout_seconds"

_lock = threading.Lock()
_here: dict[int, jax.Device] = {}  # atoll device id -> JAX device, devices of this process
_elsewhere: dict[int, jax.Device] = {}  # the same, looked up in the key-value store


# -- the launcher's side ------------------------------------------------------------
def coordinator_env(processes: int) -> dict[str, str]:
    """The runtime's parameters for host processes started here (all but the id).

    Values already in this process's environment win (``atoll up`` sets them
    when hosts join from other machines too); otherwise the coordinator gets
    a free port on this machine and every process joins from here.
    """
    coordinator = launched("jax_coordinator") or f"127.0.0.1:{free_port()}"
    return {COORDINATOR: coordinator, PROCESSES: str(launched("jax_processes") or processes)}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (its server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def serve_coordination(processes: int, host: str = "127.0.0.1") -> tuple[dict[str, str], Any]:
    """Serve JAX's coordination service here, in the launcher's process.

    By default ``jax.distributed`` serves it in process 0, whose loss then
    ends every other process ("Failed to send RPC to coordination service").
    Served by the launcher, which the cluster cannot outlive anyway, any
    host can be lost (``docs/reliability.md``, "A lost JAX host"). Returns
    the environment that tells the hosts where it is, and the service: shut
    it down once the hosts are gone. Uses JAX's own (private) constructor,
    with the options ``jax.distributed.initialize`` gives it.
    """
    from jax._src.lib import _jax  # type: ignore[attr-defined]

    port = free_port(host)
    bind = host if host in ("127.0.0.1", "localhost", "::1") else "[::]"
    service = _jax.get_distributed_runtime_service(
        f"{bind}:{port}",
        processes,
        heartbeat_timeout=heartbeat_timeout_s(),
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        recoverable=True,
    )
    env = {COORDINATOR: f"{host}:{port}", PROCESSES: str(processes), SERVICE: "launcher"}
    return env, service


# -- a host process's side -----------------------------------------------------------
def local_devices_only() -> bool:
    """Whether this is a host process whose atoll devices are its own JAX devices."""
    return bool(launched("jax_local"))


def configured() -> bool:
    """Whether this process was started to join a multi-process JAX runtime."""
    return bool(launched("jax_coordinator"))


def ensure_runtime() -> None:
    """Join the runtime once (blocking: call it on a worker thread).

    Returns when every host process has joined and JAX's backend exists, so
    ``jax.devices()`` is the global list. Does nothing unless the launcher
    configured a runtime, or when this process already joined one.
    """
    import jax

    with _lock:
        if not configured() or jax.distributed.is_initialized():
            return
        update: Any = jax.config.update
        update("jax_cpu_collectives_implementation", "gloo")
        update("jax_enable_preemption_service", False)  # its SIGTERM handler: not ours
        update("jax_enable_recoverability", True)  # a lost process does not kill the rest
        _bound_collectives()  # before the backend starts: a lost peer fails collectives
        coordinator: str = launched("jax_coordinator")
        processes, process_id = launched("jax_processes"), launched("jax_process_id")
        if processes is None or process_id is None:
            raise DeviceError(f"a JAX runtime at {coordinator} needs {PROCESSES} and {PROCESS_ID}")
        if launched("jax_service") == "launcher":
            _connect(coordinator, processes, process_id)
        else:
            jax.distributed.initialize(
                coordinator,
                processes,
                process_id,
                cluster_detection_method="deactivate",
                coordinator_bind_address=_bind_address(coordinator),
                initialization_timeout=_INIT_TIMEOUT_S,
                heartbeat_timeout_seconds=heartbeat_timeout_s(),
                shutdown_timeout_seconds=_SHUTDOWN_TIMEOUT_S,
            )
        jax.devices()  # the backend: waits for every process's topology


def _connect(coordinator: str, processes: int, process_id: int) -> None:
    """Join a runtime whose coordination service the launcher serves: what
    ``jax.distributed.initialize`` does, less starting the service in
    process 0 (JAX's private state, as of jax 0.10; the preemption service,
    which it would also start, is off)."""
    from jax._src import distributed
    from jax._src.lib import _jax  # type: ignore[attr-defined]

    client = _jax.get_distributed_runtime_client(
        coordinator,
        process_id,
        init_timeout=_INIT_TIMEOUT_S,
        use_compression=True,
        heartbeat_timeout=heartbeat_timeout_s(),
    )
    client.connect()
    state = distributed.global_state
    state.coordinator_address, state.process_id = coordinator, process_id
    state.num_processes, state.client = processes, client


def heartbeat_timeout_s() -> int:
    """How long JAX's coordination service waits for a process's heartbeat
    before it counts that process as dead: ``ATOLL_JAX_HEARTBEAT_S``, by
    default JAX's own 100 s. (With recoverability on, a process counted
    dead no longer takes the others down; see ``docs/reliability.md``.)"""
    return settings().jax_heartbeat_s


def collective_timeout_s() -> int:
    """How long one cross-process collective waits for its peers before it
    fails: ``ATOLL_JAX_COLLECTIVE_TIMEOUT_S``, by default 60 s (XLA's own is
    30 minutes). It bounds how long a survivor's shard stays stuck in a
    collective with a host that died meanwhile; it must exceed the longest
    lag between host leaders entering one program (a slow first compile)."""
    return settings().jax_collective_timeout_s


def _bound_collectives() -> None:
    """Give CPU (gloo) collectives :func:`collective_timeout_s`, unless
    ``XLA_FLAGS`` sets a timeout already. XLA reads the flag once, when the
    backend starts, for every collective of the process: a per-compile
    option (``compiler_options``) is accepted but not used by the CPU
    collectives, so it has to be the flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _COLLECTIVE_FLAG not in flags:
        bound = f"--{_COLLECTIVE_FLAG}={collective_timeout_s()}"
        os.environ["XLA_FLAGS"] = f"{flags} {bound}".strip()


def _bind_address(coordinator: str) -> str | None:
    """Where process 0 serves: loopback stays loopback; else every interface (None)."""
    host = coordinator.rsplit(":", 1)[0]
    return coordinator if host in ("127.0.0.1", "localhost") else None


def register(device_id: int, device: jax.Device) -> None:
    """Atoll device ``device_id`` of this process owns ``device``; tell the others."""
    _here[device_id] = device
    client = _client()
    if client is not None:
        client.key_value_set(_KEY.format(device_id), str(device.id), allow_overwrite=True)


def resolve_now(device_ids: Sequence[int]) -> list[jax.Device] | None:
    """The gang's JAX devices, if that needs no lookup in the runtime (else None)."""
    found = [_known(d) for d in device_ids]
    known = [device for device in found if device is not None]
    if len(known) == len(found):
        return known
    if _client() is None:
        return resolve(device_ids)
    return None


def resolve(device_ids: Sequence[int]) -> list[jax.Device]:
    """The JAX devices behind atoll devices, in order (may block: lookups).

    In one process, device ``d`` is ``jax.devices()[d]``. In a runtime shared
    by host processes, other hosts' devices come from the key-value store.
    A host process that shares no runtime sees only its own devices: a gang
    over another host's is an error.
    """
    client = _client()
    devices = []
    for d in device_ids:
        device = _known(d)
        if device is None and client is not None:
            device = _elsewhere[d] = _lookup(client, d)
        elif device is None and local_devices_only():
            raise DeviceError(
                f"atoll device {d} is on another host process, and the host processes "
                "share no JAX runtime: start them with atoll up --device jax (or "
                "process_cluster), or join with atoll host --jax-coordinator ..."
            )
        devices.append(device if device is not None else jax_device(d))
    return devices


def _known(device_id: int) -> jax.Device | None:
    if device_id in _here:
        return _here[device_id]
    return _elsewhere.get(device_id)


def _lookup(client: Any, device_id: int) -> jax.Device:
    import jax

    try:
        value = client.blocking_key_value_get(_KEY.format(device_id), _LOOKUP_TIMEOUT_MS)
    except Exception as exc:
        raise DeviceError(f"atoll device {device_id} never joined the JAX runtime: {exc}") from exc
    by_id = {device.id: device for device in jax.devices()}
    return by_id[int(value)]


def _client() -> Any:
    """The runtime's client, or None when this process joined no runtime."""
    if not configured():
        return None
    from jax._src import distributed  # the client: no public handle on its key-value store

    return distributed.global_state.client


# -- one gang ------------------------------------------------------------------------
def host_leader(device_ids: Sequence[int], devices: Sequence[jax.Device]) -> int:
    """This process's host leader of a gang: its first device here, in gang order."""
    import jax

    me = jax.process_index()
    for device_id, device in zip(device_ids, devices, strict=True):
        if device.process_index == me:
            return device_id
    raise DeviceError(f"no device of gang {list(device_ids)} is in this process")


def spans_processes(devices: Sequence[jax.Device]) -> bool:
    """Whether a gang's devices belong to more than one JAX process."""
    return len({device.process_index for device in devices}) > 1


def local_copy(array: jax.Array, device: jax.Device) -> jax.Array:
    """The copy on ``device`` of a replicated global array (a one-device array)."""
    for shard in array.addressable_shards:
        if shard.device == device:
            data: jax.Array = shard.data
            return data
    raise DeviceError(f"no copy of the output on {device}")


def jax_device(device_id: int) -> jax.Device:
    """The JAX device behind atoll device ``device_id``.

    In one process, device ``d`` is ``jax.devices()[d]``. In a cluster of host
    processes (``atoll up --device jax``), each process owns only its own
    devices: ``ATOLL_JAX_LOCAL=1`` makes ``d`` map to
    ``jax.local_devices()[d % len(jax.local_devices())]``, its place among the
    host's devices when hosts hold equal numbers.
    """
    import jax

    if local_devices_only():
        local = jax.local_devices()
        return local[device_id % len(local)]
    devices = jax.devices()
    if device_id >= len(devices):
        raise DeviceError(f"atoll device {device_id} has no JAX device: JAX sees {len(devices)}")
    return devices[device_id]
