"""``docs/deploy.md``'s SLURM recipe, run on a real single-node SLURM.

The fixture brings up Debian's SLURM on this machine (``./dev test``
installs ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` in CI, as
root with apt): a ``munged`` on a socket of its own, and ``slurmctld`` and
``slurmd`` on free ports with a configuration of its own (``SLURM_CONF``;
nothing under ``/etc`` or ``/run/munge`` is touched), all stopped
afterwards, with every job. Without SLURM, without root, or beside a SLURM
already running here, the test skips and says why.

The test takes the sbatch script from ``docs/deploy.md`` as it stands,
submits it with three tasks on this one node and simulated devices, and
the program it names connects to the cluster the script started (every
host a job step of its own, started by ``srun``), runs a computation on
every host's device, and writes what it saw; then it cancels the first
host's step with ``scancel --signal=TERM`` (preemption), and checks that the
host drained itself first: every buffer it held is read back right.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from atoll.transports.testing import eventually_blocking

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("slurmctld", "slurmd", "munged")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SLURM runs on Linux")


def _missing() -> str | None:
    """Why SLURM cannot be brought up here, or None."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"{', '.join(absent)} not installed (./dev test installs them in CI, as root)"
    if os.geteuid() != 0:
        return "its daemons are started as root"
    running = subprocess.run(["pgrep", "-x", "slurmctld|slurmd"], capture_output=True)
    if running.returncode == 0:
        return "a SLURM is already running on this machine"
    return None


def _config(tmp: Path) -> Path:
    """A one-node configuration: this machine, 8 task slots whatever its
    cores, on free ports, authenticated by the munged on ``tmp/munge.sock``."""
    node = socket.gethostname().split(".")[0]
    ctld, slurmd = _free_port(), _free_port()
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    for name in ("state", "spool", "log"):
        (tmp / name).mkdir()
    conf = tmp / "slurm.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            ClusterName=atolltest
            SlurmctldHost={node}(127.0.0.1)
            SlurmctldPort={ctld}
            SlurmdPort={slurmd}
            AuthType=auth/munge
            AuthInfo=socket={tmp}/munge.sock
            CredType=cred/munge
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SlurmUser=root
            SlurmdUser=root
            SlurmdParameters=config_overrides
            ReturnToService=2
            SlurmctldPidFile={tmp}/slurmctld.pid
            SlurmdPidFile={tmp}/slurmd.pid
            SlurmdSpoolDir={tmp}/spool
            StateSaveLocation={tmp}/state
            SlurmctldLogFile={tmp}/log/slurmctld.log
            SlurmdLogFile={tmp}/log/slurmd.log
            SchedulerType=sched/backfill
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            JobCompType=jobcomp/none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            NodeName={node} NodeAddr=127.0.0.1 CPUs=8 RealMemory={memory_mb} State=UNKNOWN
            PartitionName=atoll Nodes={node} Default=YES MaxTime=INFINITE State=UP
            """
        )
    )
    return conf


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A running single-node SLURM; the environment its commands need."""
    why = _missing()
    if why is not None:
        pytest.skip(f"no SLURM here: {why}")
    env = dict(os.environ, SLURM_CONF=str(_config(tmp_path)))
    munge = [f"--socket={tmp_path}/munge.sock", f"--pid-file={tmp_path}/munged.pid"]
    munge += [f"--seed-file={tmp_path}/munged.seed", f"--log-file={tmp_path}/log/munged.log"]
    # --force: run as root, munged wants its key owned by root, not munge
    started = [subprocess.Popen(["munged", "--foreground", "--force", *munge])]
    try:
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([daemon, "-D"], env=env, stderr=subprocess.DEVNULL))
        eventually_blocking(lambda: _node_state(env) in ("idle", "mix"), "the node idle", 60, 0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--partition=atoll"], env=env, capture_output=True)
        with suppress(AssertionError):  # its jobs (and their steps) gone first
            eventually_blocking(lambda: not _jobs(env), "every job gone", 30, 0.5)
        for process in reversed(started):
            process.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _node_state(env: dict[str, str]) -> str:
    done = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
    return done.stdout.strip()


def _jobs(env: dict[str, str]) -> list[str]:
    """The jobs SLURM still has; fails if it cannot say (its controller is gone)."""
    done = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"squeue failed: {done.stderr}"
    return done.stdout.split()


def recipe() -> str:
    """The sbatch script of ``docs/deploy.md``'s SLURM section, as it stands."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("## SLURM") :]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found is not None, "docs/deploy.md: no script under ## SLURM"
    return found.group(1)


PROGRAM = """\
import os
import subprocess
import sys

import anyio
import numpy as np

import atoll
from atoll.devices import Computation


def step_of(pid: int) -> str:
    \"\"\"The job step a process runs in (``scontrol listpids``).\"\"\"
    job = os.environ["SLURM_JOB_ID"]
    listed = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True)
    for line in listed.stdout.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == str(pid):
            return f"{job}.{fields[2]}"
    raise SystemExit(f"no step of job {job} runs pid {pid}: {listed.stdout}")


async def main() -> None:
    async with atoll.connect(sys.argv[1]) as client:
        cluster = await client.cluster("slurm-test")
        twice = Computation("twice", lambda x: np.asarray(x) * 2, 1e6)
        devices = range(len(cluster.device_infos))
        outs = [cluster.run(twice, d, [np.arange(4.0)]) for d in devices]
        values = [float((await cluster.fetch(o)).sum()) for o in outs]
        hosts = sorted({d.host for d in cluster.device_infos})
        print(f"RESULT hosts={hosts} sums={values}", flush=True)

        # preemption of one host: SIGTERM to its job step drains it first
        kept = [cluster.run(twice, d, [np.arange(70_000.0)]) for d in devices]
        for out in kept:
            await cluster.ready(out)
        rows = {r["host"]: r for r in await client.status() if r["kind"] == "host"}
        step = step_of(rows[0]["pid"])
        subprocess.run(["scancel", "--signal=TERM", step], check=True)
        while rows[0]["elastic"] != "drained":
            await anyio.sleep(0.2)
            rows = {r["host"]: r for r in await client.status() if r["kind"] == "host"}
        sums = [float((await cluster.fetch(o)).sum()) for o in kept]
        print(f"DRAINED step={step} alive={rows[0]['alive']} sums={sums}", flush=True)


anyio.run(main)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_sbatch_recipe_starts_the_hosts_and_a_program_runs(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    script, program = tmp_path / "atoll.sbatch", tmp_path / "program.py"
    script.write_text(recipe())
    program.write_text(PROGRAM)
    output = tmp_path / "job.out"
    env = dict(
        slurm,
        ATOLL_DEVICE="sim",
        ATOLL_PORT=str(_free_port()),
        ATOLL_PROGRAM=str(program),
        HOME=str(tmp_path),  # the recipe's private cluster file goes under it
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    command = ["sbatch", "--parsable", f"--output={output}", str(script)]
    submitted = subprocess.run(command, env=env, capture_output=True, text=True)
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
    job = submitted.stdout.strip().split(";")[0]
    eventually_blocking(lambda: job not in _jobs(env), f"job {job} finished", 300, 1)
    log = output.read_text() if output.exists() else "(no output)"
    found = re.search(r"^RESULT hosts=(\[.*\]) sums=(\[.*\])$", log, re.M)
    assert found is not None, log
    hosts, sums = (json.loads(part) for part in found.groups())
    assert hosts == [0, 1, 2], log  # the first task's host and the two that srun started
    assert set(sums) == {12.0} and len(sums) % 3 == 0, log  # every device computed
    drained = re.search(r"^DRAINED step=(\S+) alive=(\w+) sums=(\[.*\])$", log, re.M)
    assert drained is not None, log
    kept = json.loads(drained.group(3))
    assert set(kept) == {2 * sum(range(70_000))} and len(kept) == len(sums), log  # none lost
    assert "asked to stop, draining first" in log and "drained (" in log, log
    assert "stopped" in log, log  # atoll down ended it
