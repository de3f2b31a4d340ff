"""The parallel layout never changes the numbers: pipeline 2 x data 2 and pipeline 4 x data 1 on
4 gloo processes give the same loss per iteration as one process, and as megatron-core's own
schedules (forward_backward_no_pipelining, 1F1B) on the same model and batches."""

import json

import pytest

from tests.launch import SMALL_MODEL, assert_close, run_job

pytestmark = pytest.mark.slow


def common(data: str) -> list[str]:
    return SMALL_MODEL + ["--global-batch-size", "16", "--train-iters", "10",
                          "--lr-decay-iters", "10", "--lr", "3e-3", "--lr-warmup-iters", "2",
                          "--data-path", data, "--split", "100,0,0", "--log-interval", "5"]


@pytest.fixture(scope="module")
def single(small_data, tmp_path_factory):
    run = run_job(1, common(small_data), tmp_path_factory.mktemp("single"), name="single")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.iterations() == list(range(1, 11))
    return run


def test_megatron_core_no_pipelining_matches_single_process(single, small_data, tmp_path):
    ref = run_job(1, common(small_data) + ["--chameleon-executor", "megatron-core"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_close(ref.losses(), single.losses())


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_layouts_match_single_process(single, small_data, tmp_path, pp):
    run = run_job(4, common(small_data) + ["--pipeline-model-parallel-size", str(pp),
                                           "--tensorboard-dir", str(tmp_path / "tb")], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert_close(run.losses(), single.losses())
    consumed = [e["consumed_samples"] for e in run.metrics if e["event"] == "iteration"]
    assert consumed == [16 * i for i in range(1, 11)]
    assert all(e["world"] == 4 for e in run.metrics if e["event"] == "iteration")
    assert "training summary: 10 iterations" in run.stdout


def test_megatron_core_1f1b_matches_our_executor(single, small_data, tmp_path):
    run = run_job(4, common(small_data) + ["--pipeline-model-parallel-size", "2",
                                           "--chameleon-executor", "megatron-core"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), single.losses())


def test_resume_from_checkpoint_gives_the_same_losses(single, small_data, tmp_path):
    args = common(small_data) + ["--pipeline-model-parallel-size", "2", "--save",
                                 str(tmp_path / "ckpt")]
    first = run_job(4, [*args, "--train-iters", "5"], tmp_path, name="first")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "5"
    second = run_job(4, [*args, "--train-iters", "10", "--load", str(tmp_path / "ckpt")],
                     tmp_path, name="second")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "loaded checkpoint" in second.stdout and "at iteration 5" in second.stdout
    assert second.iterations() == list(range(6, 11))
    assert_close(second.losses(), single.losses()[5:])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt"]


def test_hand_written_uneven_plan_matches_single_process(single, small_data, tmp_path):
    """Uneven stages (1 + 3 layers) and uneven micro-batch ownership (6 + 2) from a plan file."""
    plan = {"num_layers": 4, "tensor_parallel": 1, "micro_batch_size": 2, "num_micro_batches": 8,
            "pipelines": [
                {"stages": [{"layer_start": 0, "layer_end": 1, "ranks": [0]},
                            {"layer_start": 1, "layer_end": 4, "ranks": [1]}],
                 "micro_batches": [0, 1, 2, 3, 4, 5]},
                {"stages": [{"layer_start": 0, "layer_end": 1, "ranks": [2]},
                            {"layer_start": 1, "layer_end": 4, "ranks": [3]}],
                 "micro_batches": [6, 7]}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    run = run_job(4, common(small_data) + ["--chameleon-plan", str(path)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 pipeline(s) x 2 stage(s)" in run.stdout
    assert_close(run.losses(), single.losses())


def test_rerouted_plan_with_split_backward_matches_single_process(single, small_data, tmp_path,
                                                                  monkeypatch):
    """Pipeline 2 x data 2 after losing rank 3: rank 1 hosts stage 1 of both pipelines. The
    schedule splits backwards (weight halves deferred into bubbles) and packs sends to one peer
    into one message; the numbers stay those of one process, and are the same bit for bit with
    the compiled pack/unpack and with the torch fallback (CHAMELEON_NO_EXT=1)."""
    from chameleon_ext.plan import ExecutionPlan
    from chameleon_ext.strategies.reroute import reroute
    from chameleon_ext.schedule_choice import choose_schedule

    plan = reroute(ExecutionPlan.failure_free(4, 1, 2, 4, 2, 16), {3})
    schedule = choose_schedule(plan)
    kinds = {op.kind.value for ops in schedule.ops.values() for op in ops}
    assert {"bwd_input", "bwd_weight"} <= kinds
    assert schedule.fused, "the rerouted schedule should pack some of its sends"
    path = tmp_path / "plan.json"
    plan.save(path)
    run = run_job(3, common(small_data) + ["--chameleon-plan", str(path)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), single.losses())
    assert "packed messages: cpp" in run.stdout and "of them packed" in run.stdout
    monkeypatch.setenv("CHAMELEON_NO_EXT", "1")
    fallback = run_job(3, common(small_data) + ["--chameleon-plan", str(path)], tmp_path,
                       name="no-ext")
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "packed messages: torch" in fallback.stdout
    assert fallback.losses() == run.losses()
