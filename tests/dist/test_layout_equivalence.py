"""The parallel layout never changes the numbers: pipeline 2 x data 2 and pipeline 4 x data 1 on
4 gloo processes give the same loss per iteration as one process, and as megatron-core's own
schedules (forward_backward_no_pipelining, 1F1B) on the same model and batches; so do tensor
parallel 2 (alone and in TP 2 x PP 2 x DP 2) and plans whose unit is the TP group (a lost stage's
micro-batches hosted by another pipeline's TP group, a pipeline with one stage fewer), with
dropout on: initial weights and dropout masks do not depend on the TP size. Every layout logs
the gradient's zero entries (--log-num-zeros-in-grad; here a handful of exact zeros that
rounding makes, so their count is the summation order's) and the parameters' norm
(--log-params-norm, each parameter counted once over the world: one process's norm)."""

import json
import re

import pytest

from tests.launch import SMALL_MODEL, assert_close, run_chameleon, reference_run, run_job

pytestmark = pytest.mark.slow


def common(data: str) -> list[str]:
    return SMALL_MODEL + ["--global-batch-size", "16", "--train-iters", "10",
                          "--lr-decay-iters", "10", "--lr", "3e-3", "--lr-warmup-iters", "2",
                          "--data-path", data, "--split", "100,0,0", "--log-interval", "5",
                          "--log-num-zeros-in-grad", "--log-params-norm"]


def zeros(run) -> list[int]:
    """The gradient's zero entries of each logged iteration."""
    return [int(n) for n in re.findall(r"num zeros: (\d+) \|", run.stdout)]


def params_norms(run) -> list[float]:
    """The parameters' norm of each logged iteration."""
    return [float(n) for n in re.findall(r"params norm: ([\d.]+) \|", run.stdout)]


@pytest.fixture(scope="module")
def single(small_data, tmp_path_factory):
    return reference_run(1, common(small_data), tmp_path_factory.mktemp("single"), 10, "single")


def test_megatron_core_no_pipelining_matches_single_process(single, small_data, tmp_path):
    ref = run_job(1, common(small_data) + ["--chameleon-executor", "megatron-core"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_close(ref.losses(), single.losses())


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_layouts_match_single_process(single, small_data, tmp_path, pp):
    run = run_job(4, common(small_data) + ["--pipeline-model-parallel-size", str(pp),
                                           "--tensorboard-dir", str(tmp_path / "tb"),
                                           "--check-weight-hash-across-dp-replicas-interval",
                                           "5"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert_close(run.losses(), single.losses())
    assert len(zeros(run)) == len(zeros(single)) == 2
    assert len(params_norms(single)) == 2 and params_norms(single)[0] > 0
    assert_close(params_norms(run), params_norms(single), rel=1e-4)   # printed to 3 decimals
    consumed = [e["consumed_samples"] for e in run.metrics if e["event"] == "iteration"]
    assert consumed == [16 * i for i in range(1, 11)]
    assert all(e["world"] == 4 for e in run.metrics if e["event"] == "iteration")
    checks = [e for e in run.metrics if e["event"] == "weight-hash"]
    assert [(e["iteration"], e["identical"]) for e in checks] == [(5, True), (10, True)]
    assert checks[0]["tensors"] > 0
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
    from chameleon_ext.plan.execution_plan import ExecutionPlan
    from chameleon_ext.planning.strategies.reroute import reroute
    from chameleon_ext.schedule.choice import choose_schedule

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


# With --sequence-parallel too in tests/e2e/test_strategies.py's loss of a tensor-parallel rank,
# whose iterations before the kill are this layout's and whose losses are one process's.
@pytest.mark.parametrize("world,tp,pp,extra", [(8, 2, 2, [])], ids=["tp2xpp2xdp2"])
def test_tensor_parallel_layouts_match_single_process(single, small_data, tmp_path, world, tp,
                                                      pp, extra):
    """TP 2 leaves two attention heads and half of the vocabulary to each rank."""
    run = run_job(world, common(small_data) + ["--tensor-model-parallel-size", str(tp),
                                               "--pipeline-model-parallel-size", str(pp),
                                               *extra], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"tensor parallel {tp}" in run.stdout
    assert ("sequence parallel" in run.stdout) == bool(extra)
    assert_close(run.losses(), single.losses())
    assert len(zeros(run)) == 2
    assert_close(params_norms(run), params_norms(single), rel=1e-4)


def tp2_plan(path, pipelines: list[dict]):
    """A plan of TP 2 groups, 4 layers, 8 micro-batches of 2."""
    path.write_text(json.dumps({"num_layers": 4, "tensor_parallel": 2, "micro_batch_size": 2,
                                "num_micro_batches": 8, "pipelines": pipelines}))
    return path


def test_rerouted_tensor_parallel_plan_matches_single_process(single, small_data, tmp_path):
    """TP 2 x PP 2 x DP 2 after losing pipeline 1's last stage (a whole TP group): ranks 4 and 5,
    pipeline 0's last stage, host its micro-batches; with sequence parallelism, whose
    column-parallel layers keep megatron-core's backward when the schedule splits the others'."""
    hosted = {str(mb): [4, 5] for mb in range(4, 8)}
    path = tp2_plan(tmp_path / "plan.json", [
        {"stages": [{"layer_start": 0, "layer_end": 2, "ranks": [0, 1]},
                    {"layer_start": 2, "layer_end": 4, "ranks": [4, 5]}],
         "micro_batches": [0, 1, 2, 3]},
        {"stages": [{"layer_start": 0, "layer_end": 2, "ranks": [2, 3]},
                    {"layer_start": 2, "layer_end": 4, "ranks": [], "hosts": hosted}],
         "micro_batches": [4, 5, 6, 7]}])
    run = run_job(6, common(small_data) + ["--tensor-model-parallel-size", "2",
                                           "--sequence-parallel", "--chameleon-plan", str(path)],
                  tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), single.losses())


def test_heterogeneous_tensor_parallel_plan_matches_single_process(single, small_data, tmp_path):
    """Pipelines of TP 2 groups cut differently: pipeline 0 in two stages ([0, 1) and [1, 4)),
    pipeline 1 in one (all four layers folded into one TP group, as after a takeover), with
    6 and 2 micro-batches. Under chameleon-launch the job ends by comparing every copy of every
    parameter shard: those of each tensor-parallel index must stay bit-identical."""
    path = tp2_plan(tmp_path / "plan.json", [
        {"stages": [{"layer_start": 0, "layer_end": 1, "ranks": [0, 1]},
                    {"layer_start": 1, "layer_end": 4, "ranks": [2, 3]}],
         "micro_batches": [0, 1, 2, 3, 4, 5]},
        {"stages": [{"layer_start": 0, "layer_end": 4, "ranks": [4, 5]}],
         "micro_batches": [6, 7]}])
    run = run_chameleon(6, common(small_data) + ["--tensor-model-parallel-size", "2",
                                                 "--chameleon-plan", str(path), "--chameleon"],
                        tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), single.losses())
    replicas = [e for e in run.metrics if e["event"] == "replicas"]
    # Both shards of each of the 52 parameters (4 layers x 12, embeddings, final norm).
    assert len(replicas) == 1 and replicas[0]["identical"], replicas
    assert replicas[0]["parameters"] == 2 * 52, replicas
