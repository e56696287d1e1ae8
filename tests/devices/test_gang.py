"""A gang's push targets per run (``PushTarget.under``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from atoll.devices._gang import PushTarget


def test_a_target_under_a_run_keeps_every_other_field() -> None:
    """``under`` builds the target field by field (it runs once per gang and
    run): a field it forgot would be lost silently, so each gets a value of
    its own here and must come through."""
    values: dict[str, Any] = {f.name: object() for f in dataclasses.fields(PushTarget)}
    values["keys"] = ("7/0", "8/1")
    target = PushTarget(**values)
    moved = target.under("run3")
    assert moved == dataclasses.replace(target, keys=("run3/7/0", "run3/8/1"))
    assert target.keys == ("7/0", "8/1")  # the plan's own target is left as it was
