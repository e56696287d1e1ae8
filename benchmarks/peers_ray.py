"""Run the peer benchmark scripts (``shared/peers/``) beside atoll's own.

The peers (Ray) live in their own virtual environment, as their README asks,
so atoll's benchmarks run them as a subprocess with that Python and read back
their JSON rows. Nothing here imports Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atoll.benchmarks._common import Row

__all__ = ["PeerFigure", "find_peers", "find_ray_python", "pick", "ray_figures", "ray_rows"]


def find_ray_python(explicit: str | None = None) -> str | None:
    """A Python that can ``import ray``: ``explicit``, ``.venv-ray``, or this one."""
    candidates = [explicit] if explicit else [".venv-ray/bin/python", sys.executable]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run(
                [candidate, "-c", "import ray"], capture_output=True, close_fds=False
            )
            if probe.returncode == 0:
                return os.path.abspath(candidate)  # not resolve(): keep the venv's python
    return None


def find_peers() -> Path | None:
    """The ``shared/peers`` folder beside the checkout (or beside the current folder)."""
    checkout = Path(__file__).resolve().parent.parent
    for base in (Path.cwd(), checkout):
        candidate = base.parent / "shared" / "peers"
        if (candidate / "bench_ray.py").exists():
            return candidate
    return None


def ray_rows(
    only: str, quick: bool, ray_python: str | None = None, *, echo: bool = False
) -> list[dict[str, Any]]:
    """Rows of ``bench_ray.py --only ONLY`` (empty when Ray or the peers are missing).

    ``echo``: show the script's progress on stderr (otherwise it is dropped).
    """
    python, peers = find_ray_python(ray_python), find_peers()
    if python is None or peers is None:
        print(
            "  .. ray: not available (install it in .venv-ray, or pass --ray-python)",
            file=sys.stderr,
            flush=True,
        )
        return []
    script = peers / "bench_ray.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ray.json"
        command = [python, str(script), "--only", only, "--no-dashboard", "--json", str(out)]
        if quick:
            command.append("--quick")
        print(f"  .. ray: {only} from {script}", file=sys.stderr, flush=True)
        shown = sys.stderr if echo else subprocess.DEVNULL
        subprocess.run(command, check=True, cwd=peers, stdout=shown, close_fds=False)
        rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    return rows


def pick(rows: list[dict[str, Any]], workload: str, variant: str, metric: str) -> float | None:
    """The median of one peer row, or None."""
    for row in rows:
        if (row["workload"], row["variant"], row["metric"]) == (workload, variant, metric):
            value: float = row["median"]
            return value
    return None


@dataclass(frozen=True)
class PeerFigure:
    """One peer figure to report as an atoll case: ``value * scale + offset``, in ``unit``."""

    case: str
    workload: str
    variant: str
    metric: str
    unit: str
    scale: float = 1.0
    offset: float = 0.0
    hosts: int | None = None


def ray_figures(
    bench: str, wanted: Sequence[PeerFigure], quick: bool, ray_python: str | None
) -> list[Row]:
    """Ray's rows for the ``wanted`` figures that its peer script measured."""
    rows = ray_rows(",".join(dict.fromkeys(f.workload for f in wanted)), quick, ray_python)
    found = []
    for figure in wanted:
        value = pick(rows, figure.workload, figure.variant, figure.metric)
        if value is not None:
            value = value * figure.scale + figure.offset
            found.append(Row(bench, figure.case, "ray", value, figure.unit, hosts=figure.hosts))
    return found
