"""A gang that waits aside for a push, over host processes, with a client in
a process of its own (``atoll up`` and ``connect``): a device there is sent
no promise for an earlier run's output (``PriorOutput``), so a later run on
it takes that output from the gang once it went."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from atoll.devices import Computation
from atoll.runtime.client.connect import connect
from atoll.transports.testing import line_with

from .clusters import atoll_up

pytestmark = pytest.mark.anyio


def plus_one(x: np.ndarray) -> np.ndarray:
    """(Host processes import this module by name.)"""
    return np.asarray(x) + 1


@pytest.mark.timeout(120)
async def test_a_later_run_reads_the_output_of_a_gang_waiting_aside(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.json"
    step = Computation("plus_one", plus_one, 0.02 * 1e12)  # 20 ms of device time
    with atoll_up(["--hosts", "2", "--devices-per-host", "1"], cluster_file, "33" * 16) as up:
        line_with(up, "cluster up")
        async with connect(cluster_file) as client:
            cluster = await client.cluster()
            x = await cluster.put(np.zeros(1, np.float32), 0)
            held: list[Any] = [x]
            for first, second in ((0, 1), (1, 0), (0, 1)):
                y = cluster.run(step, first, [x])
                z = cluster.run(step, second, [y])  # one program: z waits aside for y's push
                await anyio.sleep(0)  # (the batch leaves at the end of this loop turn)
                end = cluster.run(step, second, [z])  # a run of its own: z by PriorOutput
                held += [y, z, end]
            assert [(await cluster.fetch(end))[0] for end in held[3::3]] == [3, 3, 3]
            for handle in held:
                await cluster.free(handle)
            usage = await cluster.store_usage()
            assert sum(u["buffers"] for u in usage) == 0
