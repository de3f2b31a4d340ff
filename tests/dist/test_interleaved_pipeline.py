"""Megatron-LM's interleaved pipeline (--num-layers-per-virtual-pipeline-stage): each rank of a
pipeline of 2 holds 2 model chunks of 1 layer (stages 0 and 2 on the first rank, 1 and 3 on
the second) and runs the interleaved 1F1B; the losses are one process's, with the data
parallel replicas, the distributed optimizer, dropout, evaluation and a checkpoint that a
plain pipeline (one stage per rank) resumes from with the same losses."""

import pytest

from tests.launch import SMALL_MODEL, assert_close, reference_run, run_job

pytestmark = pytest.mark.slow
ITERS = 6


def common(data: str) -> list[str]:
    return SMALL_MODEL + ["--global-batch-size", "8", "--train-iters", str(ITERS),
                          "--lr-decay-iters", str(ITERS), "--lr", "3e-3",
                          "--lr-warmup-iters", "1", "--data-path", data, "--split", "90,10,0",
                          "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "3"]


@pytest.fixture(scope="module")
def single(small_data, tmp_path_factory):
    return reference_run(1, common(small_data), tmp_path_factory.mktemp("single"), ITERS,
                         "single")


def validation(run) -> list[float]:
    return [e["loss"] for e in run.metrics if e["event"] == "validation"]


def test_two_chunks_per_rank_give_one_processs_losses(single, small_data, tmp_path):
    run = run_job(4, common(small_data) + [
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"), "--save-interval",
        "3"], tmp_path, name="interleaved")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 pipeline(s) x 4 stage(s)" in run.stdout
    assert "2 model chunks per rank (interleaved), layers per stage 1, 1, 1, 1" in run.stdout
    assert_close(run.losses(), single.losses())
    assert_close(validation(run), validation(single))
    # the checkpoint of iteration 3, by layout-independent names: a plain pipeline of one
    # data-parallel replica goes on from it with the same losses
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = run_job(2, common(small_data) + [
        "--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "ckpt")],
        tmp_path, name="resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.iterations() == list(range(4, ITERS + 1))
    assert_close(resumed.losses(), single.losses()[3:])


def test_interleaved_with_tensor_and_sequence_parallelism_and_both_overlaps(single, small_data,
                                                                          tmp_path):
    """Megatron-LM's common combination: TP 2 with --sequence-parallel, the distributed
    optimizer reducing and gathering in the backward's and the next forward's hooks."""
    run = run_job(4, common(small_data) + [
        "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
        tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), single.losses())
