"""A Megatron-LM user's own command runs: the flag sets of Megatron-LM's example scripts
(examples/gpt3/train_gpt3_857m_distributed.sh and train_gpt3_175b_distributed.sh, Mixtral
8x7B's and Llama 3 8B's, their sizes shrunk to a tiny model, CUDA-only precision dropped on
CPU, the built-in byte-level data instead of their tokenizers') train on gloo; a Llama-style recipe survives a kill with the failure-free losses;
--exit-signal-handler turns a SIGTERM of the whole job into a loadable checkpoint, and of one
worker under --chameleon into its planned leave."""

import gzip
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import (REPO, SMALL_MODEL, LateKill, Run, assert_close, free_port,
                          kill_group, run_chameleon, run_job, run_script)

pytestmark = pytest.mark.slow

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32"]


def example_857m(data: str, tmp) -> list[str]:
    """The 857M script's flags, in its order; TP 8 -> 2 for two processes."""
    return [*TINY, "--attention-backend", "auto",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
            "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-5",
            "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
            "--lr-decay-iters", "430000",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
            "--data-path", data, "--split", "949,50,1",
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
            "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--eval-iters", "10",
            "--tensorboard-dir", str(tmp / "tb"), "--no-progress-bar"]


def test_megatron_lms_857m_example_flags_train(small_data, tmp_path):
    run = run_job(2, example_857m(small_data, tmp_path), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.iterations() == [1, 2, 3, 4]
    assert "no checkpoint found under" in run.stdout          # --load of an empty directory
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_megatron_lms_175b_example_flags(small_data, tmp_path):
    """With --train-iters its --rampup-batch-size is refused in one line, as Megatron-LM refuses
    it (a ramp is sample-based); without it the rest trains (TP 8 x PP 16 -> TP 2 x PP 2)."""
    flags = [f if f != "430000" else "100" for f in example_857m(small_data, tmp_path)]
    flags[flags.index("--pipeline-model-parallel-size") + 1] = "2"
    run = refused_then_trained(flags, ["--rampup-batch-size", "4", "4", "16"],
                               "--rampup-batch-size needs --train-samples", tmp_path)
    assert "pipeline(s) x 2 stage(s), tensor parallel 2" in run.stdout


def refused_then_trained(flags: list[str], refused: list[str], message: str, tmp) -> Run:
    """`flags` with `refused` added: one line naming the problem, exit 2; without: 4
    iterations on 4 processes."""
    r = run_script([*flags, *refused], env={"WORLD_SIZE": "4"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr
    run = run_job(4, flags, tmp)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.iterations() == [1, 2, 3, 4]
    return run


def example_mixtral(data: str, tmp) -> list[str]:
    """examples/mixtral/train_mixtral_8x7b_distributed.sh's flags, in its order: 8 experts ->
    4, GQA 8 -> 2 groups, PP 4 -> 2, expert parallel 8 -> 1 (refused above 1), its CUDA-only
    --moe-grouped-gemm and --bf16 dropped, the built-in data and tokenizer (its --split
    99990,8,2 leaves the small corpus no validation document: 949,50,1)."""
    return ["--use-mcore-models", "--disable-bias-linear", *TINY, "--ffn-hidden-size", "96",
            "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
            "--untie-embeddings-and-output-weights", "--group-query-attention",
            "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
            "--rotary-base", "1000000",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
            "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type",
            "alltoall", "--overlap-param-gather", "--overlap-grad-reduce",
            "--data-path", data, "--split", "949,50,1",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4",
            "--train-iters", "4", "--lr-decay-iters", "320000", "--lr-decay-style", "cosine",
            "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "500",
            "--clip-grad", "1.0",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
            "--expert-model-parallel-size", "1", "--use-distributed-optimizer",
            "--sequence-parallel",
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
            "--eval-iters", "10", "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"),
            "--tensorboard-dir", str(tmp / "tb"), "--no-load-optim", "--no-load-rng",
            "--no-progress-bar"]


def test_megatron_lms_mixtral_example_flags_train(small_data, tmp_path):
    run = refused_then_trained(example_mixtral(small_data, tmp_path), ["--moe-grouped-gemm"],
                               "--moe-grouped-gemm: grouped GEMM is a CUDA kernel", tmp_path)
    assert "2 pipeline(s) x 2 stage(s)" in run.stdout


def example_llama3_8b(data: str, tmp) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh's flags, in its order, shrunk: 4 layers,
    hidden 64, 4 heads in 2 query groups; TP 1 -> 2 with its --sequence-parallel; on CPU its
    --attention-backend fused -> auto and no --bf16, --grad-reduce-in-bf16 or fp8 (DTYPE
    bf16; fp8's flags refused in one line); --profile (nsys's, refused here) dropped with its step flags; samples 4 iterations'
    worth; the built-in data."""
    return ["--use-mcore-models", "--num-layers", "4", "--hidden-size", "64",
            "--ffn-hidden-size", "96", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
            "--max-position-embeddings", "32", "--position-embedding-type", "rope",
            "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
            "--init-method-std", "0.0134", "--attention-backend", "auto",
            "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--cross-entropy-loss-fusion",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "16",
            "--lr-decay-samples", "12", "--lr-warmup-samples", "4", "--lr", "0.00015",
            "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
            "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--calculate-per-token-loss",
            "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
            "--tensor-model-parallel-size", "2", "--context-parallel-size", "1",
            "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", "--log-interval", "1", "--eval-iters", "32",
            "--eval-interval", "100", "--save-interval", "1000", "--log-throughput",
            "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", str(tmp / "ckpt"),
            "--load", str(tmp / "ckpt"), "--tensorboard-dir", str(tmp / "tb"),
            "--data-path", data, "--split", "949,50,1", "--no-progress-bar"]


def test_megatron_lms_llama3_8b_example_flags_train(small_data, tmp_path):
    run = refused_then_trained(example_llama3_8b(small_data, tmp_path),
                               ["--fp8-format", "hybrid"], "--fp8-format: fp8 needs", tmp_path)
    assert "2 pipeline(s) x 1 stage(s), tensor parallel 2" in run.stdout


def test_the_pytorch_profiler_traces_megatron_lms_window(small_data, tmp_path):
    """--profile --use-pytorch-profiler --profile-step-start 1 --profile-step-end 3 on rank 1:
    its chrome trace of iterations 2 and 3, beside the tensorboard directory."""
    run = run_job(2, [*SMALL_MODEL, "--global-batch-size", "4", "--train-iters", "4",
                      "--data-path", small_data, "--split", "100,0,0", "--profile",
                      "--use-pytorch-profiler", "--profile-step-start", "1",
                      "--profile-step-end", "3", "--profile-ranks", "1",
                      "--tensorboard-dir", str(tmp_path / "tb")], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    traces = sorted((tmp_path / "torch_profile").iterdir())
    assert [t.name for t in traces] == ["rank-1.json.gz"]
    with gzip.open(traces[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


LLAMA = ["--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type",
         "rope", "--untie-embeddings-and-output-weights", "--qk-layernorm",
         "--init-method-std", "0.02", "--norm-epsilon", "1e-6", "--rotary-base", "500000"]


def llama(data: str, iters: int = 8, pp: int = 2, model: list[str] = LLAMA) -> list[str]:
    return SMALL_MODEL + model + [
        "--pipeline-model-parallel-size", str(pp), "--global-batch-size", "16", "--train-iters",
        str(iters), "--lr", "3e-3", "--lr-warmup-fraction", "0.1", "--data-path", data,
        "--split", "100,0,0"]


@pytest.fixture(scope="module")
def llama_reference(small_data, tmp_path_factory):
    """One process: the layout does not change the losses."""
    run = run_job(1, llama(small_data, pp=1), tmp_path_factory.mktemp("llama"), name="llama-1")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.losses()


def test_a_llama_style_recipe_survives_a_kill(llama_reference, small_data, tmp_path):
    """On Megatron-LM's uneven split (--decoder-last-pipeline-num-layers: 1 + 3 layers)."""
    run = run_chameleon(4, llama(small_data) + [
        "--decoder-last-pipeline-num-layers", "3", "--log-params-norm",
        "--chameleon", "--chameleon-inject", "kill:rank=3,iter=4,phase=backward"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), llama_reference)
    assert run.stdout.count("params norm: ") == 8
    assert "per iteration, layers per stage 1, 3" in run.stdout
    assert len([e for e in run.metrics if e["event"] == "recovery"]) == 1
    replicas = [e for e in run.metrics if e["event"] == "replicas"]
    assert replicas and replicas[0]["identical"], replicas


def test_sigterm_to_the_agent_saves_a_loadable_checkpoint(llama_reference, small_data,
                                                          tmp_path):
    """The agent's SIGTERM goes to every worker: they agree to stop after the same iteration,
    save it and exit 0; a second job loads it and goes on with the failure-free losses."""
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "first.jsonl"
    cmd = [sys.executable, "-m", "chameleon_ext.control.launcher", "--nproc-per-node", "4",
           "--master-port", str(free_port()), str(REPO / "pretrain_gpt.py"),
           *llama(small_data, 400), "--lr-decay-iters", "8", "--chameleon",
           "--exit-signal-handler", "--save", str(ckpt),
           "--chameleon-metrics-file", str(metrics)]
    agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True,
                             env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                                  "PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + 120     # the job's start on 2 loaded cores
        while time.monotonic() < deadline and (
                not metrics.exists() or metrics.read_text().count('"iteration"') < 3):
            time.sleep(0.2)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=60)
    finally:
        kill_group(agent.pid)
    stopped = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= stopped < 400, err[-3000:]
    assert f"exiting after iteration {stopped}: SIGTERM" in out
    assert err.count("exited 0") == 4, err[-3000:]
    resumed = run_job(4, llama(small_data) + ["--load", str(ckpt)], tmp_path, name="second")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if stopped < 8:
        assert resumed.iterations() == list(range(stopped + 1, 9))
        assert_close(resumed.losses(), llama_reference[stopped:])


def test_sigterm_to_one_worker_is_its_planned_leave(llama_reference, small_data, tmp_path):
    """Rank 2 is preempted after iteration 1: it leaves at the step boundary, exit 0, and the
    others go on without it, losing no iteration."""
    port = free_port()
    # the tool sees progress up to half a second late (the heartbeat's period): the 6
    # iterations left after iteration 1 (about 0.2 s each idle) leave it that time on a
    # loaded host, where 4 left had run out before the SIGTERM
    term = LateKill(port, 2, 1, 0, term=True).start()
    run = run_chameleon(4, llama(small_data) + ["--chameleon", "--exit-signal-handler"],
                        tmp_path, launcher_args=["--master-port", str(port)])
    term.join()
    assert term.returncode == 0, term.stderr
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), llama_reference)
    assert "launch rank(s) [2] left on SIGTERM" in run.stdout + run.stderr
    assert "worker rank 2" in run.stderr and "exited 0" in run.stderr
    recoveries = [e for e in run.metrics if e["event"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["lost_iterations"] == 0, recoveries


def test_checkpoint_flags_of_a_finetuning_user(llama_reference, small_data, tmp_path):
    """A Llama-style checkpoint of iteration 4 resumed with --use-checkpoint-args (no model
    flags given: the checkpoint's shape) gives the failure-free losses; --no-load-optim goes on
    from iteration 4 with a fresh optimizer; --finetune starts over at iteration 1 from its
    parameters."""
    ckpt = str(tmp_path / "ckpt")
    first = run_job(1, llama(small_data, pp=1) + ["--save", ckpt, "--exit-interval", "4"],
                    tmp_path, name="first")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "exiting after iteration 4: --exit-interval 4" in first.stdout
    # the model's shape comes from the checkpoint; what is not a shape stays the job's own
    plain = llama(small_data, pp=1, model=["--init-method-std", "0.02"])
    shape = run_job(1, plain + ["--load", ckpt, "--use-checkpoint-args"], tmp_path,
                    name="checkpoint-args")
    assert shape.returncode == 0, shape.stderr[-3000:]
    assert shape.iterations() == [5, 6, 7, 8]
    assert_close(shape.losses(), llama_reference[4:])
    fresh = run_job(1, llama(small_data, pp=1) + ["--load", ckpt, "--no-load-optim"], tmp_path,
                    name="no-load-optim")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert fresh.iterations() == [5, 6, 7, 8] and fresh.losses()[0] == pytest.approx(
        llama_reference[4], rel=1e-5)              # the same parameters: the same first loss
    assert fresh.losses()[1] != pytest.approx(llama_reference[5], rel=1e-5)   # a fresh Adam
    tuned = run_job(1, llama(small_data, pp=1) + ["--load", ckpt, "--finetune"], tmp_path,
                    name="finetune")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "to fine-tune from iteration 0" in tuned.stdout
    assert tuned.iterations() == list(range(1, 9))
    assert tuned.losses()[0] != pytest.approx(llama_reference[0], rel=1e-3)   # trained weights
    # --skip-train: the checkpoint evaluated on a validation split, nothing trained or saved
    evaluated = run_job(1, llama(small_data, pp=1) + [
        "--load", ckpt, "--save", ckpt, "--skip-train", "--eval-iters", "1", "--split",
        "90,10,0"], tmp_path, name="skip-train")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "> --skip-train: evaluating iteration 4, no training" in evaluated.stdout
    assert re.search(r"validation loss at iteration 4 \| lm loss value: \S+ \|",
                     evaluated.stdout)
    assert evaluated.iterations() == [] and (Path(ckpt) / "latest_checkpointed_iteration.txt"
                                             ).read_text() == "4"
