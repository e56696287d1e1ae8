"""``atoll bench accelerator``, tiny: every form, in-process and over a host
process, fused and not, beside plain JAX in the same process (a process of
its own per size, with XLA pinned to one thread as the benchmark does)."""

from __future__ import annotations

import json

import pytest

from atoll.benchmarks import accelerator
from atoll.benchmarks._common import Row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_form_is_measured_beside_plain_jax(capsys: pytest.CaptureFixture[str]) -> None:
    assert accelerator.main(["--tiny", "--json", "--sizes", "16"]) == 0
    rows = [Row(**json.loads(line)) for line in capsys.readouterr().out.splitlines()]
    by = {(row.case, row.system): row for row in rows}
    for form in accelerator.FORMS:
        for where in accelerator.WHERE:
            case = f"{form} 16² {where}"
            for variant in ("", " unfused"):  # each beside plain JAX in its own process
                jax_us = by[case, f"jax{variant}"].value
                assert jax_us is not None and jax_us > 0
                us, ratio = by[case, f"atoll{variant}"].value, by[case, f"ratio{variant}"].value
                peak = by[case, f"peak{variant}"].value
                assert us is not None and us > 0
                # the ratio is printed to 3 decimals, each time to 1 (0.05 µs off
                # at most): below 0.1, or for times of a few µs, that is over 1%
                slack = 0.01 + 0.05 / jax_us + 0.05 / us
                assert ratio == pytest.approx(jax_us / us, rel=slack, abs=1e-3)
                assert peak is not None and peak < 1 << 20  # a handful of 512-byte outputs
    assert by["program 16² inproc", "target"].value == 0.5  # the small size's target


def test_the_table_says_which_targets_are_met() -> None:
    rows = [
        Row("accelerator", "program 64² inproc", "jax", 20.0, "us/step"),
        Row("accelerator", "program 64² inproc", "atoll", 50.0, "us/step"),
        Row("accelerator", "program 64² inproc", "ratio", 0.4, "jax/atoll"),
        Row("accelerator", "program 64² inproc", "target", 0.5, "jax/atoll"),
        Row("accelerator", "program 64² inproc", "peak", 2**20, "bytes"),
        Row("accelerator", "chain 512² inproc", "ratio", 0.95, "jax/atoll"),
        Row("accelerator", "chain 512² inproc", "target", 0.9, "jax/atoll"),
    ]
    table = accelerator._render(rows).splitlines()
    assert "MISSED" in table[1] and "1.0" in table[1]
    assert "met" in table[2] and "MISSED" not in table[2]
