"""Runnable examples; each is checked against plain JAX or numpy by a test.

- ``spmd``: an SPMD training step of a small MLP over 8 devices.
- ``pipeline``: a GPipe-style pipeline of a tiny transformer, 4 stages on 4 hosts.
- ``two_islands``: a program whose value crosses the "datacenter network".
- ``custom_scheduler``: a user's own island scheduler, selected by name.
- ``partitioned_pipeline``: a pipeline whose stages the partitioner chose.
- ``multi_tenant``: four clients of weights 1, 2, 4, 8 share one island.
- ``train_lm``: a GPT-style language model trained data-parallel, beside plain
  JAX (``atoll run train_lm --help``; needs the ``[train]`` extra).
- ``colocated``: the hosts prepare a slice's data and label a JAX program's
  output, beside their devices (``--hosts 2``: in two host processes).
"""

import importlib
import os

__all__ = ["EXAMPLES", "run_example", "use_fake_cpu_devices"]

EXAMPLES = (
    "spmd",
    "pipeline",
    "two_islands",
    "custom_scheduler",
    "partitioned_pipeline",
    "multi_tenant",
    "train_lm",
    "colocated",
)


def use_fake_cpu_devices(n: int = 8) -> None:
    """Ask XLA for ``n`` host (CPU) devices; call before JAX first touches a device.

    It only affects the CPU platform, so on a machine with GPUs JAX still uses them.
    """
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def run_example(name: str, backend: str = "asyncio", argv: list[str] | None = None) -> int:
    """Run one example's ``main`` (for ``atoll run NAME [OPTIONS]``); returns
    an exit code. ``argv``: the example's own options, for those that take any."""
    import functools
    import inspect

    import anyio

    if name not in EXAMPLES:
        raise SystemExit(f"no example {name!r}; known: {', '.join(EXAMPLES)}")
    use_fake_cpu_devices()
    module = importlib.import_module(f"atoll.examples.{name}")
    main = module.main
    if inspect.signature(main).parameters:
        main = functools.partial(main, argv or [])
    elif argv:
        raise SystemExit(f"atoll run {name} takes no options (given: {' '.join(argv)})")
    anyio.run(main, backend=backend)
    return 0
