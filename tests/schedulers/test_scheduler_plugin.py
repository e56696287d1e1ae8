"""The worked scheduler plugin of ``docs/schedulers.md``, installed as a package.

``examples/scheduler_plugin`` is built and installed with pip (into a
folder of its own, next to this environment's atoll), and a fresh
interpreter that has it on its path finds both of its entry points by name,
runs gangs through the policy on an in-process cluster, and gets each
result right; the policy's own ``validate`` holds after every event.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[2] / "examples" / "scheduler_plugin"

CHECK = """
import anyio, numpy as np, atoll
from atoll.devices import Computation
from atoll.schedulers import Completed, Submit, get_scheduler, scheduler_names

assert {"priority", "priority-deep"} <= set(scheduler_names()), scheduler_names()
assert get_scheduler("priority-deep").depth == 8

policy = get_scheduler("priority")  # the state machine alone: the heavier session first
assert [d.gang_id for d in policy.handle(Submit(0, "a", (0,), "light", 1.0))] == ["a"]
assert policy.handle(Submit(1, "b", (0,), "light", 1.0))[0].gang_id == "b"
assert policy.handle(Submit(2, "c", (0,), "light", 1.0)) == []  # device 0 is 2 deep
assert policy.handle(Submit(3, "d", (0,), "heavy", 5.0)) == []
sent = policy.handle(Completed(4, "a", 0))
assert [(i.gang_id, i.cause, i.seq) for i in sent] == [("d", 4, 2)], sent  # jumps the queue
policy.validate()

async def main():
    step = Computation("double", lambda x: 2 * x, 1e6)
    async with atoll.local_cluster(1, 2, 2, scheduler="priority") as cluster:
        outs = [cluster.run(step, d % 4, [np.full(3, float(d))]) for d in range(24)]
        got = [await cluster.fetch(out) for out in outs]
    assert all((g == 2.0 * d).all() for d, g in enumerate(got))
    print("plugin ok")

anyio.run(main)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_plugin_package_installs_and_its_policies_run_by_name(tmp_path: Path) -> None:
    target, source = tmp_path / "site", tmp_path / "plugin"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    install += ["--target", str(target), str(source)]  # built from a copy: the tree stays clean
    built = subprocess.run(install, capture_output=True, text=True, timeout=180, close_fds=False)
    assert built.returncode == 0, built.stderr
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        close_fds=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "plugin ok"
