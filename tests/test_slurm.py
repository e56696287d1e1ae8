"""``docs/deploy.md``'s SLURM recipe, run on a real single-node SLURM.

The fixture brings up Debian's SLURM on this machine: it installs
``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` with apt when they
are missing (as root, as CI runs), starts ``munged``, ``slurmctld`` and
``slurmd`` with a configuration of its own (``SLURM_CONF``; ``/etc`` is not
touched), and stops them afterwards. Without root and apt, and without
SLURM, the test skips and says why.

The test takes the sbatch script from ``docs/deploy.md`` as it stands,
submits it with three tasks on this one node and simulated devices, and
the program it names connects to the cluster the script started (a host
beside the controller, two more by ``srun``), runs a computation on every
host's device, and writes what it saw.
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
from pathlib import Path

import pytest

from atoll.transports.testing import eventually_blocking

ROOT = Path(__file__).resolve().parent.parent
DAEMONS = ("slurmctld", "slurmd", "munged")
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SLURM runs on Linux")


def _installed() -> bool:
    return all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS)


def _install() -> str | None:
    """Install SLURM with apt where it may; why not, otherwise."""
    if _installed():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "SLURM is not installed, and installing it needs root and apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}"
    return None


def _config(tmp: Path) -> Path:
    """A one-node configuration: this machine, 8 task slots whatever its cores."""
    node = socket.gethostname().split(".")[0]
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    for name in ("state", "spool", "log"):
        (tmp / name).mkdir()
    conf = tmp / "slurm.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            ClusterName=atolltest
            SlurmctldHost={node}
            SlurmctldPort=6917
            SlurmdPort=6918
            AuthType=auth/munge
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
            NodeName={node} CPUs=8 RealMemory={memory_mb} State=UNKNOWN
            PartitionName=atoll Nodes={node} Default=YES MaxTime=INFINITE State=UP
            """
        )
    )
    return conf


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A running single-node SLURM; the environment its commands need."""
    why = _install()
    if why is not None:
        pytest.skip(f"no SLURM here: {why}")
    if os.geteuid() != 0:
        pytest.skip("no SLURM here: its daemons are started as root")
    env = dict(os.environ, SLURM_CONF=str(_config(tmp_path)))
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    started = [subprocess.Popen(["munged", "--foreground", "--force"], env=env)]
    try:
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([daemon, "-D"], env=env, stderr=subprocess.DEVNULL))
        sinfo = ["sinfo", "-h", "-o", "%t"]

        def idle() -> bool:
            done = subprocess.run(sinfo, env=env, capture_output=True, text=True)
            return done.stdout.strip() in ("idle", "mix")

        eventually_blocking(idle, "the SLURM node idle", timeout=60, every=0.5)
        yield env
    finally:
        for process in reversed(started):
            process.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def recipe() -> str:
    """The sbatch script of ``docs/deploy.md``'s SLURM section, as it stands."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("## SLURM") :]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found is not None, "docs/deploy.md: no script under ## SLURM"
    return found.group(1)


PROGRAM = """\
import sys

import anyio
import numpy as np

import atoll
from atoll.devices import Computation


async def main() -> None:
    async with atoll.connect(sys.argv[1]) as client:
        cluster = await client.cluster("slurm-test")
        twice = Computation("twice", lambda x: np.asarray(x) * 2, 1e6)
        outs = [cluster.run(twice, d, [np.arange(4.0)]) for d in range(len(cluster.device_infos))]
        values = [float((await cluster.fetch(o)).sum()) for o in outs]
        hosts = sorted({d.host for d in cluster.device_infos})
        print(f"RESULT hosts={hosts} sums={values}", flush=True)


anyio.run(main)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


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
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={output}", str(script)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]

    def finished() -> bool:
        done = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True)
        return job not in done.stdout

    try:
        eventually_blocking(finished, f"SLURM job {job} finished", timeout=300, every=1)
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)
    log = output.read_text() if output.exists() else "(no output)"
    found = re.search(r"^RESULT hosts=(\[.*\]) sums=(\[.*\])$", log, re.M)
    assert found is not None, log
    hosts, sums = (json.loads(part) for part in found.groups())
    assert hosts == [0, 1, 2], log  # the first task's host and the two that srun started
    assert set(sums) == {12.0} and len(sums) % 3 == 0, log  # every device computed
    assert "stopped" in log, log  # atoll down ended it
