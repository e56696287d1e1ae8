"""The examples run, and match plain single-process JAX (or numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from atoll.examples import (
    colocated,
    multi_tenant,
    partitioned_pipeline,
    pipeline,
    spmd,
    two_islands,
)

pytestmark = pytest.mark.anyio


async def test_spmd_training_matches_single_device_jax() -> None:
    result = await spmd.run(steps=3)
    ref = spmd.reference(steps=3)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-5)
    assert result.losses[0] != result.losses[-1]  # it trained
    for got, want in zip(result.params, ref.params, strict=True):
        np.testing.assert_allclose(got["w"], want["w"], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
async def test_gpipe_pipeline_matches_the_unpipelined_model() -> None:
    result = await pipeline.run(batch=8, micro_batches=4)
    np.testing.assert_allclose(result.outputs, pipeline.reference(batch=8), atol=1e-5)
    assert result.nodes == 16  # 4 stages x 4 micro-batches
    assert result.per_stage_computations == [8, 8, 8, 8]  # 4 nodes x 2 shards per host


async def test_two_islands_cross_the_datacenter_link() -> None:
    result = await two_islands.run()
    np.testing.assert_allclose(result.output, two_islands.reference(), atol=1e-6)
    assert result.islands_of_work == [0, 1]
    assert result.transfer_s == pytest.approx(result.modelled_s)
    # charged at the datacenter link's rate, not the one inside an island
    assert result.transfer_s > two_islands.COST.transfer_time(result.crossed_bytes)


async def test_the_hosts_prepare_and_label_what_a_jax_program_scores() -> None:
    result = await colocated.run(steps=2)
    np.testing.assert_array_equal(result.labels, colocated.reference(steps=2))
    assert result.client_array_bytes is None  # one process: nothing goes by socket
    assert result.tokenized == {0: 2 * colocated.ROWS}  # the host's actor kept count


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # host processes: capnp
@pytest.mark.timeout(180)
async def test_over_two_host_processes_each_prepares_its_own_rows() -> None:
    import os

    result = await colocated.run(steps=2, hosts=2)
    np.testing.assert_array_equal(result.labels, colocated.reference(steps=2))
    assert all(len(pids) == 2 and os.getpid() not in pids for pids in result.pids)
    assert result.client_array_bytes == 0
    assert result.tokenized == {0: colocated.ROWS, 1: colocated.ROWS}  # each its own rows


async def test_the_partitioner_splits_a_pipeline_that_matches_the_model() -> None:
    out, split = await partitioned_pipeline.run(micro_batches=4)
    np.testing.assert_allclose(out, partitioned_pipeline.reference(), atol=1e-5)
    assert [i for stage in split.stages for i in stage] == list(range(12))  # a chain split
    assert all(split.stages)  # every device has a stage
    assert split.throughput > split.even_throughput  # better than cutting evenly


@pytest.mark.slow
async def test_four_clients_get_device_time_by_their_weights() -> None:
    shares = await multi_tenant.run(seconds=0.5)
    for weight in multi_tenant.WEIGHTS:
        assert shares.share(weight) == pytest.approx(shares.due(weight), rel=0.05)
    assert shares.utilization > 0.99  # virtual time: the device never waits


def test_examples_run_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's path; the custom scheduler example also checks itself here."""
    from atoll.examples import EXAMPLES, run_example

    assert set(EXAMPLES) == {
        "spmd",
        "pipeline",
        "two_islands",
        "custom_scheduler",
        "partitioned_pipeline",
        "multi_tenant",
        "train_lm",
        "colocated",
    }
    assert run_example("custom_scheduler") == 0
    assert "matches numpy: True" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no example"):
        run_example("nope")
    with pytest.raises(SystemExit, match="takes no options"):
        run_example("custom_scheduler", argv=["--steps", "3"])
