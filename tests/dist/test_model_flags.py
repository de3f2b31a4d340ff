"""Megatron-LM's model flags keep the layout out of the numbers: a Llama-style model (SwiGLU,
grouped-query attention, RMSNorm with zero-centred weights, RoPE, QK layernorm, untied output
and embeddings on their own learning rate, no biases; documents masked from each other; the
loss the batch's token mean) on TP 2 x PP 2 with sequence parallelism, a DeepSeek-style mixture of experts
(sigmoid scores, group-limited top-k, a shared expert; the loss per token) on TP 2 x PP 2 (which needs sequence
parallelism; its per-sequence load-balancing loss scaled like the main loss; with full
recompute), a gpt-oss-style mixture (quick GeGLU experts, Llama 3's RoPE
scaling, the all-to-all token dispatcher, an fp32 router with z-loss) on Megatron-LM's uneven
first stage, activation recompute, and a batch-size ramp (4, 8, then 12 samples per iteration;
the tied embeddings on their own learning rate) give one process's losses (1e-5)."""

import pytest

from tests.launch import SMALL_MODEL, assert_close, run_job

pytestmark = pytest.mark.slow

LLAMA = ["--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type",
         "rope", "--untie-embeddings-and-output-weights", "--qk-layernorm",
         "--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask",
         "--apply-layernorm-1p", "--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-4",
         "--calculate-per-token-loss"]
RAMP = ["--train-samples", "60", "--rampup-batch-size", "4", "4", "16", "--global-batch-size",
        "12", "--lr-warmup-samples", "8", "--decoupled-lr", "1e-2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-load-balancing-type", "seq_aux_loss", "--disable-bias-linear",
       "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5",
       "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
       "--moe-shared-expert-intermediate-size", "64", "--calculate-per-token-loss"]
GPT_OSS = ["--quick-geglu", "--position-embedding-type", "rope", "--no-position-embedding",
           "--use-rope-scaling", "--rope-scaling-factor", "32", "--num-experts", "4",
           "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear",
           "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32",
           "--moe-z-loss-coeff", "1e-3", "--no-masked-softmax-fusion", "--no-rope-fusion"]


def common(data: str, *model: str) -> list[str]:
    """The Llama-style model trains on megatron-core's mock data: its short documents put
    end-of-document tokens in every batch, which the built-in corpus's long files do not."""
    span = [] if "--train-samples" in model else ["--global-batch-size", "8", "--train-iters",
                                                   "4"]
    source = ["--mock-data"] if "--eod-mask-loss" in model else ["--data-path", data]
    return SMALL_MODEL + span + list(model) + ["--lr", "3e-3", *source, "--split", "100,0,0"]


@pytest.fixture(scope="module")
def singles(small_data, tmp_path_factory):
    """One process per model: the references."""
    out = {}
    micro_batch_means = [f for f in LLAMA if f != "--calculate-per-token-loss"]
    for name, model in (("llama", LLAMA), ("moe", MOE), ("gpt-oss", GPT_OSS), ("ramp", RAMP),
                        ("llama-micro-batch-means", micro_batch_means)):
        run = run_job(1, common(small_data, *model), tmp_path_factory.mktemp(name), name=name)
        assert run.returncode == 0, run.stderr[-3000:]
        out[name] = run.losses()
    assert len({tuple(v) for v in out.values()}) == 5      # the flags change the model
    # with end-of-document tokens masked, the batch's token mean is not the micro-batches' mean
    assert out["llama"] != pytest.approx(out["llama-micro-batch-means"], rel=1e-6)
    return out


# Recompute changes no number: the layouts below run with it, their references without.
@pytest.mark.parametrize("name, model, world, layout", [
    ("llama", LLAMA + ["--recompute-activations"], 4, [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel"]),
    ("moe", MOE + ["--recompute-granularity", "full", "--recompute-method", "block",
                   "--recompute-num-layers", "1"], 4, [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel"]),
    ("gpt-oss", GPT_OSS, 4, [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", "--decoder-first-pipeline-num-layers", "1"]),
    ("ramp", RAMP + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"], 4, ["--pipeline-model-parallel-size", "2"]),
], ids=["llama-selective-recompute-tp2xpp2-sp", "moe-seq-aux-loss-full-recompute-tp2xpp2-sp",
        "gpt-oss-style-tp2xpp2-sp-first-stage-1-layer", "ramp-full-recompute-pp2xdp2"])
def test_model_flags_match_one_process(singles, small_data, tmp_path, name, model, world,
                                       layout):
    run = run_job(world, common(small_data, *model) + layout, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), singles[name])
