"""The partitioner never fails where a valid partition exists (issue 39, point 4).

A repair that runs out of time falls back to a valid partition known
already (the last it returned, else the best contiguous split) instead of
ending the search; "no valid partition" is said only when the solver proves
it, and a timeout with nothing known says that time ran out, and how to
give more. The default time limit grows with the graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from atoll.partition import Chiplets, RepairTimeout, _repair, bert_graph, search
from atoll.partition._cost import is_valid_array
from atoll.partition._repair import Repairer, repair_time_limit


def _messy(n: int, chips: int, seed: int = 0) -> np.ndarray:
    """A candidate far from valid: chiplets at random."""
    return np.random.default_rng(seed).integers(0, chips, n).astype(np.int64)


def test_a_repair_out_of_time_falls_back_to_a_valid_partition() -> None:
    graph = bert_graph()
    chips = Chiplets.default_for(graph, 4)
    repairer = Repairer(graph, chips, time_limit_s=1e-9)  # no solve can finish
    got = repairer(_messy(len(graph), chips.count))
    assert is_valid_array(graph, chips, got)  # the best contiguous split
    assert repairer.fallbacks == 1


def test_a_search_with_too_little_repair_time_still_returns_a_valid_partition() -> None:
    graph = bert_graph()
    part = search(graph, 4, method="sa", budget=8, repair_time_limit_s=1e-9)
    assert part.valid and part.throughput > 0


def test_out_of_time_with_nothing_known_says_time_ran_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import atoll.partition._dp as dp

    monkeypatch.setattr(dp, "dp_split", lambda graph, chiplets: None)  # no split to fall on
    graph = bert_graph()
    chips = Chiplets.default_for(graph, 4)
    with pytest.raises(RepairTimeout) as caught:
        Repairer(graph, chips, time_limit_s=1e-9)(_messy(len(graph), chips.count))
    text = str(caught.value)
    assert "did not rule one out" in text and "repair_time_limit_s=" in text
    assert "has no valid partition" not in text  # not proven: not said


def test_the_default_repair_time_grows_with_the_graph() -> None:
    assert repair_time_limit(bert_graph()) == 5.0
    big = type("G", (), {"__len__": lambda self: 1000})()
    assert repair_time_limit(big) == pytest.approx(15.0)
    assert _repair.Repairer(bert_graph(), Chiplets.default_for(bert_graph(), 4)).time_limit_s == 5.0


def test_the_solver_out_of_time_falls_back_to_a_valid_partition() -> None:
    """``method="solver"`` with no time to find anything: the best contiguous split,
    marked, not an error (a 673-op graph on a ring of 16 took longer than RL did)."""
    graph = bert_graph()
    part = search(graph, 4, method="solver", time_limit_s=1e-9)
    assert part.valid and part.throughput > 0
    assert part.extra["fell_back"] and not part.extra["optimal"]
