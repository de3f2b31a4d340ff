"""--use-distributed-optimizer (megatron-core's DistributedOptimizer on gloo) on pipeline 2 x data 4:
the losses of the plain optimizer, with each rank holding a quarter of its Adam state (half with
two instances), overlapped reduce-scatters and parameter all-gathers included; its checkpoint,
saved whole under the plain optimizer's keys, resumes under data parallel 3 (and one stage)
with the same losses."""

import json
import re
import shutil

import pytest

from tests.launch import SMALL_MODEL, assert_close, reference_run, run_job

pytestmark = pytest.mark.slow

# Micro-batches of 1 in a global batch of 12: whole pipelines at data parallel 4 and 3.
ITERS = 8


def common(data: str, pp: int = 2) -> list[str]:
    return SMALL_MODEL + ["--micro-batch-size", "1", "--global-batch-size", "12",
                          "--pipeline-model-parallel-size", str(pp), "--train-iters", str(ITERS),
                          "--lr-decay-iters", str(ITERS), "--lr", "3e-3",
                          "--lr-warmup-iters", "2", "--data-path", data, "--split", "100,0,0",
                          "--log-interval", "4", "--log-params-norm"]


def optimizer_bytes(run) -> dict[int, int]:
    """Each rank's Adam state, as the job's memory event measured it."""
    ranks = next(e for e in run.metrics if e["event"] == "memory")["ranks"]
    return {r["rank"]: r["optimizer_bytes"] for r in ranks}


@pytest.fixture(scope="module")
def plain(small_data, tmp_path_factory):
    return reference_run(8, common(small_data), tmp_path_factory.mktemp("plain"), ITERS, "plain")


@pytest.fixture(scope="module")
def overlapped(small_data, tmp_path_factory):
    """The sharded optimizer with both overlaps, saving at iterations 4 and 8."""
    work = tmp_path_factory.mktemp("overlapped")
    run = run_job(8, common(small_data) + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--save", str(work / "ckpt"), "--save-interval", "4"], work, name="overlapped")
    assert run.returncode == 0, run.stderr[-3000:]
    return run, work / "ckpt"


def assert_shards(run, plain, parts: int) -> None:
    mine, whole = optimizer_bytes(run), optimizer_bytes(plain)
    assert set(mine) == set(whole) == set(range(8))
    for r in whole:
        # each DDP bucket is padded to a multiple of the group: a few elements more than 1/parts
        assert abs(mine[r] * parts / whole[r] - 1) < 0.01, (r, mine[r], whole[r])


def params_norms(run) -> list[float]:
    return [float(n) for n in re.findall(r"params norm: ([\d.]+) \|", run.stdout)]


def test_sharded_optimizer_with_overlaps_matches_the_plain_one(plain, overlapped):
    """... and so does the parameters' norm, each rank's shard counted once."""
    run, _ = overlapped
    assert_close(run.losses(), plain.losses())
    assert len(params_norms(plain)) == 2
    assert_close(params_norms(run), params_norms(plain), rel=1e-4)
    assert_shards(run, plain, 4)
    assert "of it optimizer state" in run.stdout


def test_two_instances_match_and_hold_half(plain, small_data, tmp_path):
    run = run_job(8, common(small_data) + ["--use-distributed-optimizer",
                                           "--num-distributed-optimizer-instances", "2"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), plain.losses())
    assert_shards(run, plain, 2)


def test_sharded_checkpoint_resumes_under_another_data_parallel_size(plain, overlapped,
                                                                     small_data, tmp_path):
    _, saved = overlapped
    half = tmp_path / "ckpt"
    half.mkdir()
    shutil.copytree(saved / "iter_0000004", half / "iter_0000004")
    (half / "latest_checkpointed_iteration.txt").write_text("4")
    meta = json.loads((half / "iter_0000004" / "meta.json").read_text())
    assert meta["iteration"] == 4
    # 3 processes: the keys are layout-independent, the pipeline depth may change too
    run = run_job(3, common(small_data, pp=1) + ["--use-distributed-optimizer", "--load",
                                                 str(half)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.iterations() == list(range(5, ITERS + 1))
    assert_close(run.losses(), plain.losses()[4:])
