"""The GPT-style language model trained through atoll matches plain JAX.

A tiny config trains 20 steps data-parallel over 4 devices, in this process
and over a host process; its losses equal those of the same steps in plain
JAX on one device (float32; the all-reduce sums in another order, so not
bit for bit). Also: the model's pieces, the data, and the command line.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from atoll.kernel import AtollError

pytest.importorskip("optax", reason="the [train] extra (optax) is not installed")

from atoll.examples import (
    lm,
    lm_pipeline,
    train_lm,
)

TINY = lm.CONFIGS["tiny"]
STEPS = 20
RTOL = 1e-5  # float32, summed in another order
BF16_RTOL = 1e-3  # bfloat16 against one device, 20 steps (measured: 3.9e-5)


@pytest.fixture(scope="module")
def reference() -> train_lm.TrainResult:
    return train_lm.reference(TINY, STEPS)


def test_the_data_is_bytes_of_the_standard_library_split_by_file() -> None:
    train, held_out = lm.corpus("train"), lm.corpus("eval")
    assert train.dtype == np.uint8 and len(train) > 10 * len(held_out) // 2 > 0
    batch = lm.batch_at(3, TINY)
    assert batch.shape == (TINY.batch, TINY.context + 1) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, lm.batch_at(3, TINY))  # the same every run
    assert not np.array_equal(batch, lm.batch_at(4, TINY))
    assert not np.array_equal(batch, lm.batch_at(3, TINY, "eval"))
    with pytest.raises(ValueError, match="split"):
        lm.corpus("test")


@pytest.mark.slow
def test_the_model_is_causal_and_starts_near_uniform() -> None:
    params = lm.init(TINY)
    tokens = lm.batch_at(0, TINY)[:, :-1]
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    before, after = (np.asarray(lm.logits(params, t, TINY.heads)) for t in (tokens, changed))
    np.testing.assert_allclose(before[:, :-1], after[:, :-1], rtol=1e-5)  # no peeking ahead
    assert not np.allclose(before[:, -1], after[:, -1])
    loss = float(lm.loss_fn(params, lm.batch_at(0, TINY), TINY.heads))
    assert abs(loss - math.log(256)) < 0.1


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of heads"):
        TINY.with_(width=30, heads=4)
    with pytest.raises(ValueError, match="positive"):
        TINY.with_(layers=0)
    with pytest.raises(ValueError, match="mlp"):
        TINY.with_(mlp=(4,))  # one multiple per block


def test_the_partitioner_balances_uneven_blocks_where_equal_counts_do_not() -> None:
    uneven = lm.CONFIGS["uneven"]
    for stages in (2, 3):
        cut = lm_pipeline.cut(uneven, stages, uneven.batch // 4)
        assert cut.blocks != lm_pipeline.even_cut(uneven, stages).blocks
        assert cut.throughput > 1.1 * cut.even_throughput  # the model's own figures
    params = lm.init(uneven)
    assert params["blocks"][0]["fc"]["w"].shape == (128, 16 * 128)
    assert params["blocks"][5]["fc"]["w"].shape == (128, 128)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_uneven_blocks_train_pipelined_as_plain_jax(anyio_backend: str) -> None:
    config = TINY.with_(layers=3, mlp=(8, 1, 1))
    cut = lm_pipeline.cut(config, 2, config.batch // 2)
    assert cut.blocks == ((0,), (1, 2))  # the heavy block alone
    async with train_lm.cluster_for(2, hosts=0, in_process_hosts=2) as cluster:
        result = await train_lm.train_pipelined(cluster, config, 5, cut, 2, 1)
    expected = train_lm.reference(config, 5)
    np.testing.assert_allclose(result.losses, expected.losses, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_data_parallel_training_in_process_matches_plain_jax(
    anyio_backend: str, reference: train_lm.TrainResult
) -> None:
    seen: list[train_lm.StepReport] = []
    async with train_lm.cluster_for(4, hosts=0) as cluster:
        result = await train_lm.train(cluster, TINY, STEPS, 4, seen.append)
    np.testing.assert_allclose(result.losses, reference.losses, rtol=RTOL)
    if anyio_backend == "asyncio":  # plain JAX with the same shardings: the same bits
        assert result.losses == train_lm.reference(TINY, STEPS, devices=4).losses
    assert [r.step for r in seen] == list(range(STEPS))
    assert result.losses[-1] < result.losses[0] - 0.5  # it learns
    _assert_trees_close(result.params, reference.params)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # host processes: capnp
@pytest.mark.timeout(240)
async def test_data_parallel_training_over_a_host_process_matches_plain_jax(
    anyio_backend: str, reference: train_lm.TrainResult
) -> None:
    async with train_lm.cluster_for(4, hosts=1) as cluster:
        result = await train_lm.train(cluster, TINY, STEPS, 4)
    np.testing.assert_allclose(result.losses, reference.losses, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_pipelined_training_in_process_matches_plain_jax(
    anyio_backend: str, reference: train_lm.TrainResult
) -> None:
    """Two stages on two hosts, two devices each, two micro-batches (GPipe)."""
    cut = lm_pipeline.cut(TINY, 2, TINY.batch // 2)
    assert [b for part in cut.blocks for b in part] == list(range(TINY.layers))
    async with train_lm.cluster_for(4, hosts=0, in_process_hosts=2) as cluster:
        result = await train_lm.train_pipelined(cluster, TINY, STEPS, cut, 2, 2)
    np.testing.assert_allclose(result.losses, reference.losses, rtol=RTOL)
    _assert_trees_close(result.params, reference.params)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # host processes: capnp
@pytest.mark.timeout(240)
async def test_pipelined_training_over_host_processes_matches_plain_jax(
    anyio_backend: str, reference: train_lm.TrainResult
) -> None:
    """Three stages (one with no block: the head alone) in three host processes."""
    cut = lm_pipeline.Cut(((0,), (1,), ()))
    async with train_lm.cluster_for(3, hosts=3) as cluster:
        result = await train_lm.train_pipelined(cluster, TINY, STEPS, cut, 4, 1)
    np.testing.assert_allclose(result.losses, reference.losses, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_run_resumed_from_a_checkpoint_equals_an_uninterrupted_one(
    anyio_backend: str, tmp_path: Path
) -> None:
    """10 steps, saved from the hosts; a new cluster restores them (onto its
    device 3, not where they were) and goes on: the same 10 losses after as
    20 steps in one go (the same program, so bit for bit)."""
    pytest.importorskip("orbax.checkpoint", reason="the [train] extra (orbax) is missing")
    async with train_lm.cluster_for(2, hosts=0) as cluster:
        whole = await train_lm.train(cluster, TINY, STEPS, 2)
    async with train_lm.cluster_for(2, hosts=0) as cluster:
        first = await train_lm.train(cluster, TINY, STEPS // 2, 2)
        await cluster.save({"step": STEPS // 2, "state": first.state}, tmp_path / "ck")
    assert (tmp_path / "ck" / "host0").is_dir()  # written by the host
    with pytest.raises(AtollError, match="never written over"):
        async with train_lm.cluster_for(2, hosts=0) as cluster:
            await cluster.save({"x": 1}, tmp_path / "ck")
    async with train_lm.cluster_for(4, hosts=0) as cluster:
        saved = await cluster.restore(tmp_path / "ck", device=3)
        assert saved["step"] == STEPS // 2
        rest = await train_lm.train(cluster, TINY, STEPS // 2, 2, start=10, state=saved["state"])
    assert first.losses + rest.losses == whole.losses


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # host processes: capnp
@pytest.mark.timeout(240)
async def test_a_checkpoint_is_written_by_the_host_processes_and_resumed(
    anyio_backend: str, tmp_path: Path, reference: train_lm.TrainResult
) -> None:
    pytest.importorskip("orbax.checkpoint", reason="the [train] extra (orbax) is missing")
    async with train_lm.cluster_for(2, hosts=1) as cluster:
        first = await train_lm.train(cluster, TINY, STEPS // 2, 2)
        await cluster.save(first.state, tmp_path / "ck")
    async with train_lm.cluster_for(2, hosts=1) as cluster:
        state = await cluster.restore(tmp_path / "ck")
        rest = await train_lm.train(cluster, TINY, STEPS // 2, 2, start=10, state=state)
    np.testing.assert_allclose(first.losses + rest.losses, reference.losses, rtol=RTOL)


@pytest.mark.anyio
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("anyio_backend", "hosts"),
    [("asyncio", 0), ("trio", 0), ("asyncio", 1)],
    ids=["asyncio", "trio", "host-process"],
)
@pytest.mark.slow
async def test_an_evaluation_tenant_scores_a_checkpoint_while_the_trainer_goes_on(
    anyio_backend: str, hosts: int, tmp_path: Path, reference: train_lm.TrainResult
) -> None:
    """The trainer (weight 4) checkpoints at step 10 and goes on; meanwhile
    an evaluation session (weight 1) restores that checkpoint into its own
    session and scores the held-out split. Both are right. (Each ``train``
    call takes a slice of its own: six devices for the three.)"""
    pytest.importorskip("orbax.checkpoint", reason="the [train] extra (orbax) is missing")
    async with train_lm.cluster_for(6, hosts=hosts) as cluster:
        evaluator = cluster.client("evaluator")
        await cluster.controller.set_tenant(cluster.owner, 4)
        await cluster.controller.set_tenant(evaluator.owner, 1)
        first = await train_lm.train(cluster, TINY, STEPS // 2, 2)
        await cluster.save(first.state, tmp_path / "ck")
        scores: list[float] = []
        rest: list[train_lm.TrainResult] = []

        async def go_on() -> None:
            state = first.state
            rest.append(await train_lm.train(cluster, TINY, STEPS // 2, 2, start=10, state=state))

        async def score() -> None:
            params, _ = await evaluator.restore(tmp_path / "ck")
            scores.extend(await train_lm.evaluate(evaluator, TINY, params, 4, 2))

        async with anyio.create_task_group() as tg:
            tg.start_soon(go_on)
            tg.start_soon(score)
    np.testing.assert_allclose(first.losses + rest[0].losses, reference.losses, rtol=RTOL)
    saved_params = train_lm.reference(TINY, STEPS // 2).params
    want = train_lm.reference_eval(TINY, saved_params, 4)
    np.testing.assert_allclose(scores, want, rtol=1e-4)


def test_stage_parameters_split_and_join_back() -> None:
    params = lm.init(TINY.with_(layers=5))
    parts = lm_pipeline.split_params(params, ((0, 1), (2,), (3, 4)))
    assert [len(p["blocks"]) for p in parts] == [2, 1, 2]
    assert "wte" in parts[0] and "ln_f" in parts[-1] and "wte" not in parts[1]
    joined = lm_pipeline.join_params(parts)
    assert joined["blocks"][3] is params["blocks"][3] and joined["wte"] is params["wte"]
    with pytest.raises(ValueError, match="stages"):
        lm_pipeline.cut(TINY, 9, 4)


@pytest.mark.slow
def test_the_command_prints_json_steps_and_a_final_line_with_the_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atoll.cli import main

    plot = tmp_path / "loss.png"
    args = ["run", "train_lm", "--config", "tiny", "--steps", "6", "--data-parallel", "2"]
    assert main([*args, "--json", "--plot", str(plot)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    steps, final = lines[:-1], lines[-1]
    assert [s["step"] for s in steps] == list(range(6))
    assert all(s["tokens_per_s"] > 0 and s["loss"] > 0 for s in steps)
    assert max(s["tokens_per_s"] for s in steps) < 3 * final["tokens_per_s"]  # the work's rate
    assert len(final["reference_loss"]) == 6 and final["max_relative_gap"] < RTOL
    assert final["max_relative_gap_same_devices"] == 0.0  # the same program, bit for bit
    assert plot.stat().st_size > 1000


def _assert_trees_close(got: Any, want: Any) -> None:
    """Equal to a small fraction of how far training moved them (about lr x
    steps = 0.06): AdamW turns the all-reduce's rounding in near-zero
    gradients into steps of up to lr."""
    import jax

    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_the_command_saves_resumes_and_numbers_the_steps_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("orbax.checkpoint", reason="the [train] extra (orbax) is missing")
    from atoll.cli import main

    monkeypatch.chdir(tmp_path)
    ck = str(tmp_path / "ck")
    base = ["run", "train_lm", "--config", "tiny", "--data-parallel", "2", "--json"]
    quick = [*base, "--no-reference"]
    assert main([*quick, "--steps", "4", "--save", ck]) == 0
    assert not list(tmp_path.glob("*.png"))  # no picture unless asked (--plot)
    capsys.readouterr()
    assert main([*quick, "--steps", "3", "--resume", ck, "--backend", "trio"]) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["step"] for s in steps[:-1]] == [4, 5, 6] and steps[-1]["steps"] == 3
    with pytest.raises(SystemExit, match="resume with the --config"):
        main([*quick, "--steps", "1", "--resume", ck, "--pipeline", "2"])
    with pytest.raises(SystemExit, match="never written over"):
        main([*quick, "--steps", "1", "--save", ck])  # refused before any training


def test_backend_after_the_examples_name_is_atolls() -> None:
    from atoll.cli import _backend_of

    assert _backend_of("asyncio", ["--steps", "3", "--backend", "trio"]) == (
        "trio",
        ["--steps", "3"],
    )
    assert _backend_of("trio", ["--backend=asyncio"]) == ("asyncio", [])
    assert _backend_of("asyncio", ["--steps", "3"]) == ("asyncio", ["--steps", "3"])
    with pytest.raises(SystemExit, match="asyncio or trio"):
        _backend_of("asyncio", ["--backend", "curio"])


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_bfloat16_training_equals_plain_jax_on_the_same_devices(anyio_backend: str) -> None:
    """Mixed precision (bfloat16 computation, float32 master weights and
    AdamW): bit for bit against plain JAX with the same shardings, and
    within BF16_RTOL of plain JAX on one device."""
    config = TINY.with_(dtype="bfloat16")
    async with train_lm.cluster_for(4, hosts=0) as cluster:
        result = await train_lm.train(cluster, config, STEPS, 4)
    assert result.losses == train_lm.reference(config, STEPS, devices=4).losses
    one = train_lm.reference(config, STEPS).losses
    np.testing.assert_allclose(result.losses, one, rtol=BF16_RTOL)
    assert result.losses[-1] < result.losses[0] - 0.5


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_1f1b_pipeline_in_bfloat16_matches_plain_jax(anyio_backend: str) -> None:
    config = TINY.with_(dtype="bfloat16")
    cut = lm_pipeline.Cut(((0,), (1,), ()))
    async with train_lm.cluster_for(3, hosts=0, in_process_hosts=3) as cluster:
        result = await train_lm.train_pipelined(cluster, config, STEPS, cut, 4, 1, schedule="1f1b")
    np.testing.assert_allclose(
        result.losses, train_lm.reference(config, STEPS).losses, rtol=BF16_RTOL
    )


def test_a_1f1b_schedule_keeps_few_micro_batches_in_flight_per_stage() -> None:
    order = lm_pipeline.schedule(4, 8, "1f1b")
    assert sorted(order) == sorted(lm_pipeline.schedule(4, 8, "gpipe"))
    for stage in range(3):  # forwards done, backwards not yet: at most 4 - stage
        mine = [(k, m) for k, s, m in order if s == stage]
        waiting = peak = 0
        for kind, _ in mine:
            waiting += 1 if kind == "F" else -1
            peak = max(peak, waiting)
        assert peak == 4 - stage, (stage, mine)
    gpipe = [(k, m) for k, s, m in lm_pipeline.schedule(4, 8, "gpipe") if s == 0]
    assert gpipe[:8] == [("F", m) for m in range(8)]  # GPipe: every forward first
    with pytest.raises(ValueError, match="schedule"):
        lm_pipeline.schedule(2, 2, "zigzag")


@pytest.mark.slow
def test_the_rate_skips_the_first_fifth_of_the_steps() -> None:
    result = train_lm.TrainResult([], tokens_per_step=100)
    result.finished_at = [10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5, 14.0, 14.5]
    assert result.overall_tokens_per_s() == pytest.approx(100 * 8 / 4.0)  # from step 1 on
    assert train_lm.reference(TINY, 1).overall_tokens_per_s() > 0  # one step has a rate too


# -- the input pipeline on the hosts (--input hosts, examples/lm_input.py) -------------
def test_a_hosts_rows_are_those_of_the_clients_batch() -> None:
    from atoll.examples import lm_input

    for step in (0, 7):
        whole = lm.batch_at(step, TINY)
        for rows in (slice(0, 4), slice(4, 8), slice(2, 6)):
            np.testing.assert_array_equal(lm_input.batch_rows(step, TINY, rows), whole[rows])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_batches_made_on_the_hosts_train_as_the_clients_bit_for_bit(
    anyio_backend: str,
) -> None:
    async with train_lm.cluster_for(4, hosts=0) as cluster:
        hosts = await train_lm.train(cluster, TINY, STEPS, 4, input_from="hosts")
        client = await train_lm.train(
            cluster, TINY, STEPS, 4, input_from="client", slices=hosts.slices
        )
    assert hosts.losses == client.losses
    assert hosts.input_state is not None and int(hosts.input_state["next_step"]) == STEPS
    assert client.input_state is None and hosts.client_bytes_per_step is None  # no sockets
    with pytest.raises(ValueError, match="input_from must be one of"):
        async with train_lm.cluster_for(2, hosts=0) as cluster:
            await train_lm.train(cluster, TINY, 1, 2, input_from="disk")


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_hosts_input_resumes_exactly_from_a_checkpoint(
    anyio_backend: str, tmp_path: Path
) -> None:
    """The input's position is saved with the model's state; a new cluster
    goes on from it and sees the batches an uninterrupted run sees."""
    pytest.importorskip("orbax.checkpoint", reason="the [train] extra (orbax) is missing")
    half = STEPS // 2
    async with train_lm.cluster_for(2, hosts=0) as cluster:
        whole = await train_lm.train(cluster, TINY, STEPS, 2, input_from="hosts")
        first = await train_lm.train(
            cluster, TINY, half, 2, input_from="hosts", slices=whole.slices
        )
        saved = {"step": half, "state": first.state, "input": first.input_state}
        await cluster.save(saved, tmp_path / "ck")
    async with train_lm.cluster_for(2, hosts=0) as cluster:
        back = await cluster.restore(tmp_path / "ck")
        resume = functools.partial(
            train_lm.train,
            cluster,
            TINY,
            state=back["state"],
            input_from="hosts",
            input_state=back["input"],
        )
        rest = await resume(half, 2, start=half)
        with pytest.raises(ValueError, match="goes on from step 10, not 3"):
            await resume(1, 2, start=3, slices=rest.slices)
    assert first.losses + rest.losses == whole.losses


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # host processes: capnp
@pytest.mark.timeout(300)
async def test_over_two_host_processes_no_batch_byte_leaves_the_client(
    anyio_backend: str,
) -> None:
    """Data-parallel over 4 devices in 2 host processes: the same losses
    either way, bit for bit; the client sends each batch with ``--input
    client``, and no array at all with ``--input hosts``."""
    async with train_lm.cluster_for(4, hosts=2) as cluster:
        hosts = await train_lm.train(cluster, TINY, STEPS, 4, input_from="hosts", over_sockets=True)
        client = await train_lm.train(
            cluster, TINY, STEPS, 4, input_from="client", over_sockets=True, slices=hosts.slices
        )
    assert hosts.losses == client.losses
    batch_bytes = lm.batch_at(0, TINY).nbytes
    assert hosts.client_array_bytes_per_step == 0
    assert client.client_array_bytes_per_step is not None
    assert client.client_array_bytes_per_step >= batch_bytes


def test_the_command_refuses_hosts_input_for_a_pipeline() -> None:
    from atoll.cli import main

    args = ["run", "train_lm", "--config", "tiny", "--steps", "1", "--pipeline", "2"]
    with pytest.raises(SystemExit, match="micro-batches come from the client"):
        main([*args, "--input", "hosts"])
