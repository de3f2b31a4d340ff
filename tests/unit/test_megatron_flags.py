"""Megatron-LM's flags: each one honoured (it reaches the job's config with Megatron's meaning)
or refused with one line naming it; checked in-process on the parser (the end-to-end runs are
in tests/e2e/test_megatron_recipes.py)."""

import math

import pytest

from megatron.training.arguments import ArgumentError, parse_config

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32"]


def config(*flags: str, world: int = 1):
    return parse_config([*BASE, *flags], world_size=world)


def refusal(*flags: str, world: int = 1) -> str:
    with pytest.raises(ArgumentError) as e:
        config(*flags, world=world)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_llama_style_flags_reach_the_model_config():
    m = config("--swiglu", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear", "--normalization", "RMSNorm", "--use-rotary-position-embeddings",
               "--rotary-base", "500000", "--untie-embeddings-and-output-weights",
               "--qk-layernorm", "--norm-epsilon", "1e-6", "--kv-channels", "16",
               "--attention-backend", "unfused").model
    assert (m.swiglu, m.num_query_groups, m.add_bias_linear, m.normalization) == \
        (True, 2, False, "RMSNorm")
    assert (m.position_embedding_type, m.rotary_base, m.tied_embeddings, m.qk_layernorm) == \
        ("rope", 500000, False, True)
    assert (m.norm_epsilon, m.kv_channels, m.attention_backend) == (1e-6, 16, "unfused")
    # Megatron-LM's SwiGLU default: 2/3 of 4h, down to a multiple of 64
    assert m.ffn_hidden_size == 128
    assert config().model.num_query_groups is None      # without --group-query-attention


def test_the_transformer_config_is_megatron_lms():
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnBackend

    from megatron.training.training import transformer_config
    m = config("--swiglu", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "1",
               "--moe-router-pre-softmax",
               "--moe-aux-loss-coeff", "0.01", "--recompute-granularity", "full",
               "--recompute-method", "block", "--recompute-num-layers", "1").model
    tc = transformer_config(m, 1)
    assert tc.gated_linear_unit and tc.activation_func is F.silu and not tc.add_bias_linear
    assert (tc.num_query_groups, tc.num_moe_experts, tc.moe_router_topk) == (2, 4, 1)
    assert tc.moe_aux_loss_coeff == 0.01 and tc.attention_backend is AttnBackend.auto
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == \
        ("full", "block", 1)


def test_samples_fractions_and_exit_flags():
    t = config("--train-samples", "10", "--global-batch-size", "4", "--micro-batch-size", "2",
               "--lr-warmup-fraction", "0.25").training
    assert t.train_iters == 3                           # the last batch completes the samples
    assert t.schedule_samples() == (2, 10)              # warm-up: a quarter of the decay span
    t = config("--train-iters", "8", "--lr-warmup-fraction", "0.5").training
    assert t.schedule_samples() == (8, 16)
    t = config("--train-samples", "40", "--lr-warmup-samples", "4",
               "--lr-decay-samples", "20").training
    assert t.schedule_samples() == (4, 20)
    t = config("--exit-interval", "5", "--exit-duration-in-mins", "0.5",
               "--exit-signal-handler", "--manual-gc", "--manual-gc-interval", "3").training
    assert (t.exit_interval, t.exit_duration_s, t.exit_signal_handler) == (5, 30.0, True)
    assert (t.manual_gc, t.manual_gc_interval) == (True, 3)


def test_a_batch_ramp_counts_as_megatron_lm_does():
    t = config("--train-samples", "60", "--global-batch-size", "12", "--micro-batch-size", "2",
               "--rampup-batch-size", "4", "4", "16").training
    # two increments of 8 samples each: 4, 4, then 8 after 8 samples, 12 after 16
    assert [t.ramp.global_batch(c) for c in (0, 4, 8, 15, 16, 1000)] == [4, 4, 8, 8, 12, 12]
    assert t.ramp.first_samples(60) == [0, 4, 8, 16, 28, 40, 52]
    assert t.train_iters == 7 and t.first_global_batch == 4


def test_data_checkpoint_and_logging_flags():
    c = config("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask",
               "--num-workers", "4", "--dataloader-type", "cyclic", "--no-load-optim",
               "--log-throughput", "--log-timers-to-tensorboard", "--ckpt-format", "torch_dist")
    assert (c.data.eod_mask_loss, c.data.reset_position_ids, c.data.reset_attention_mask) == \
        (True, True, True)
    assert (c.data.num_workers, c.data.dataloader_type) == (4, "cyclic")
    assert (c.checkpoint.load_optim, c.checkpoint.finetune) == (False, False)
    assert c.logging.log_throughput and c.logging.log_timers_to_tensorboard
    c = config("--use-mcore-models", "--no-mmap-bin-files", "--empty-unused-memory-level", "1",
               "--no-create-attention-mask-in-dataloader")
    assert not c.data.mmap_bin_files and c.training.empty_unused_memory_level == 1
    c = config("--finetune")
    assert (c.checkpoint.load_optim, c.checkpoint.finetune) == (False, True)


@pytest.mark.parametrize("flags, message", [
    (["--rampup-batch-size", "16", "16", "1000"], "--rampup-batch-size needs --train-samples"),
    (["--rampup-batch-size", "2", "2", "8", "--train-samples", "64", "--chameleon",
      "--global-batch-size", "8"], "--rampup-batch-size: not with --chameleon yet"),
    (["--rampup-batch-size", "2", "4", "8", "--train-samples", "64", "--global-batch-size", "8"],
     "not the start plus a whole number of increments"),
    (["--rampup-batch-size", "2", "2", "8", "--train-samples", "64", "--global-batch-size", "8",
      "--micro-batch-size", "4"], "must be a multiple of --micro-batch-size x data parallel"),
    (["--context-parallel-size", "2"], "--context-parallel-size: context parallelism"),
    (["--expert-model-parallel-size", "2", "--num-experts", "4"],
     "--expert-model-parallel-size: expert parallelism"),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size 2 or more"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size", "2",
      "--chameleon"], "--num-layers-per-virtual-pipeline-stage: not with --chameleon yet"),
    (["--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"],
     "--num-layers 4 is not a multiple of 2 stages x 3 layers"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage",
      "1", "--pipeline-model-parallel-size", "2"], "exclude each other"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-model-parallel-size", "2",
      "--chameleon-executor", "megatron-core"],
     "does not go with --chameleon-executor megatron-core yet"),

    (["--bf16", "--use-distributed-optimizer", "--chameleon"],
     "--bf16: not with --use-distributed-optimizer and --chameleon yet"),
    (["--use-distributed-optimizer", "--chameleon", "--chameleon-redundancy", "eager"],
     "--use-distributed-optimizer: not with --chameleon-redundancy eager yet"),
    (["--chameleon-shard-redundancy", "buddy", "--chameleon"],
     "--chameleon-shard-redundancy buddy needs --use-distributed-optimizer and --chameleon"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--num-distributed-optimizer-instances", "2"], "needs --use-distributed-optimizer"),
    (["--num-distributed-optimizer-instances", "2", "--use-distributed-optimizer"],
     "--num-distributed-optimizer-instances 2 does not divide the data parallel size 1"),
    (["--fp8-format", "hybrid"], "--fp8-format: fp8"),
    (["--moe-grouped-gemm", "--num-experts", "2"], "--moe-grouped-gemm:"),
    (["--async-save"], "--async-save: saves are synchronous"),
    (["--ckpt-format", "torch"], "invalid choice: 'torch'"),
    (["--attention-backend", "flash"], "--attention-backend flash is a transformer-engine kernel"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--num-experts", "2", "--moe-router-topk", "3"], "--moe-router-topk 3 must be in 1..--num"),
    (["--num-experts", "2"], "--num-experts needs --disable-bias-linear"),
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-method", "uniform"], "go with --recompute-granularity full"),
    (["--train-iters", "4", "--train-samples", "8"], "exclude each other"),
    (["--train-samples", "8", "--lr-decay-iters", "4"], "go with --train-iters"),
    (["--lr-decay-samples", "8"], "go with --train-samples"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "excludes --lr-warmup-iters"),
    (["--swiglu", "--hidden-size", "16", "--num-attention-heads", "4"],
     "--swiglu's default --ffn-hidden-size is 0"),
    (["--exit-interval", "0"], "--exit-interval must be positive"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--cross-entropy-fusion-impl", "native"],
     "--cross-entropy-fusion-impl goes with --cross-entropy-loss-fusion"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
     "--cross-entropy-fusion-impl te needs transformer-engine and CUDA"),
    (["--use-legacy-models"], "--use-legacy-models: the legacy models are gone"),
    (["--rerun-mode", "validate_results"], "--rerun-mode: only disabled"),
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer: the optimizer keeps"),
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype: only fp32"),
    (["--main-grads-dtype", "bf16"], "--main-grads-dtype: only fp32"),
    (["--ddp-average-in-collective"], "--ddp-average-in-collective: gradients are summed"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be at least 1"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2: FSDP is not supported"),
    (["--tp-comm-overlap"], "--tp-comm-overlap: transformer-engine's userbuffers"),
    (["--delay-wgrad-compute"], "--delay-wgrad-compute: transformer-engine's delayed"),
    (["--initial-loss-scale", "65536"], "--initial-loss-scale go(es) with --fp16"),
    (["--log-memory-to-tensorboard", "--tensorboard-dir", "tb"],
     "--log-memory-to-tensorboard logs CUDA's allocator statistics: it needs CUDA"),
    (["--log-world-size-to-tensorboard"],
     "--log-world-size-to-tensorboard go(es) with --tensorboard-dir"),
    (["--tensorboard-dir", "tb", "--tensorboard-log-interval", "0"],
     "--tensorboard-log-interval must be at least 1"),
    (["--lr-wsd-decay-iters", "4"], "--lr-wsd-decay-iters go(es) with --lr-decay-style WSD"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters N >= 1"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "8"],
     "--lr-wsd-decay-samples goes with --train-samples; use --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30"],
     "--lr-wsd-decay-iters: the annealing phase is longer than the decay span"),
    (["--start-weight-decay", "0.1"], "go with --weight-decay-incr-style linear|cosine"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2",
      "--end-weight-decay", "0.1"], "needs --start-weight-decay and --end-weight-decay, 0 <="),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"],
     "exclude each other"),
    (["--save", "ck", "--save-interval", "4", "--save-retain-interval", "6"],
     "--save-retain-interval must be a multiple of --save-interval"),
    (["--non-persistent-save-interval", "10"], "--non-persistent-save-interval: every checkpoint"),
    (["--log-straggler"], "--log-straggler: the straggler detector needs CUDA"),
    (["--q-lora-rank", "64"], "--q-lora-rank: goes with multi-latent attention, which is not"),
    (["--fsdp-double-buffer"], "--fsdp-double-buffer: goes with Megatron FSDP"),
    (["--sft"], "--sft: supervised fine-tuning's chat data is not supported"),
    (["--full-validation"], "--full-validation: each evaluation takes --eval-iters"),
    (["--ckpt-assume-constant-structure"], "--ckpt-assume-constant-structure: each save plans"),
    (["--num-dataset-builder-threads", "0"], "--num-dataset-builder-threads must be at least 1"),
    (["--skip-train", "--eval-iters", "0"], "--skip-train evaluates: --eval-iters must be"),
    (["--profile"], "--profile: only with --use-pytorch-profiler"),
    (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler needs --tensorboard-dir"),
    (["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb",
      "--profile-step-start", "3", "--profile-step-end", "3"],
     "--profile needs 0 <= --profile-step-start < --profile-step-end"),
    (["--wandb-project", "p"], "--wandb-project: wandb is not installed"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"],
     "--reset-attention-mask needs the loader's attention mask"),
    (["--swiglu", "--squared-relu"], "--swiglu and --squared-relu exclude each other"),
    (["--no-position-embedding"], "--no-position-embedding is deprecated (as in Megatron-LM)"),
    (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
    (["--rope-type", "yarn"], "--rope-type: yarn goes with multi-latent attention"),
    (["--multi-latent-attention"], "--multi-latent-attention: multi-latent attention is not"),
    (["--window-size", "127,0"], "--window-size: sliding-window attention is not supported"),
    (["--use-flash-attn"], "--attention-backend flash is a transformer-engine kernel"),
    (["--use-flash-attn", "--attention-backend", "local"],
     "--use-flash-attn is --attention-backend flash, not local"),
    (["--moe-layer-freq", "2"], "--moe-layer-freq: only 1"),
    (["--moe-token-dispatcher-type", "alltoall"], "--moe-token-dispatcher-type needs --num-expe"),
    (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function needs --num-exp"),
    (["--moe-router-dtype", "fp32"], "--moe-router-dtype needs --num-experts"),
    (["--moe-z-loss-coeff", "1e-3"], "--moe-z-loss-coeff needs --num-experts"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-router-group-topk", "1"],
     "--moe-router-group-topk needs --moe-router-num-groups"),
    (["--position-embedding-type", "rope", "--rope-scaling-factor", "32"],
     "--rope-scaling-factor needs --use-rope-scaling"),
    (["--rope-type", "rope"], "--rope-type needs --position-embedding-type rope"),
    (["--profile-step-start", "4"], "--profile-step-start goes with --profile"),
    (["--use-pytorch-profiler"], "--use-pytorch-profiler goes with --profile"),
    (["--profile-ranks", "0"], "--profile-ranks goes with --profile"),
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias: the expert bias"),
    (["--moe-shared-expert-intermediate-size", "64"],
     "--moe-shared-expert-intermediate-size needs --num-experts"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type: flex needs DeepEP"),
    (["--moe-permute-fusion"], "--moe-permute-fusion: the fused permutation is a CUDA kernel"),
    (["--optimizer", "sgd"], "--optimizer: only adam"),
    (["--checkpoint-activations"], "--checkpoint-activations: no longer valid"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp: Megatron FSDP is not supported"),
    (["--use-nccl-ub"], "--use-nccl-ub: NCCL user-buffer registration"),
    (["--fp8-param-gather"], "--fp8-param-gather: fp8"),
    (["--decoder-first-pipeline-num-layers", "2"], "need a pipeline of at least 2 stages"),
])
def test_unsupported_or_inconsistent_flags_are_refused_in_one_line(flags, message):
    assert message in refusal(*flags)


def test_activation_rope_moe_and_nan_flags_reach_the_transformer_config():
    from megatron.core.activations import quick_gelu, squared_relu

    from megatron.training.training import transformer_config
    relu = transformer_config(config("--squared-relu").model, 1)
    assert relu.activation_func is squared_relu and not relu.gated_linear_unit
    geglu = config("--quick-geglu").model
    assert geglu.gated_linear_unit and geglu.ffn_hidden_size == 256   # 4h, no SwiGLU rule
    tc = transformer_config(geglu, 1)
    assert tc.activation_func is quick_gelu and tc.gated_linear_unit
    m = config("--position-embedding-type", "rope", "--no-position-embedding",
               "--use-rope-scaling", "--rope-scaling-factor", "32",
               "--rotary-seq-len-interpolation-factor", "2", "--rope-type", "rope").model
    assert (m.rope_scaling, m.rope_scaling_factor, m.rotary_interpolation) == (True, 32.0, 2)
    moe = config("--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type",
                 "alltoall", "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3",
                 "--moe-layer-freq", "1").model
    tc = transformer_config(moe, 1)
    assert (tc.moe_token_dispatcher_type, tc.moe_router_dtype, tc.moe_z_loss_coeff) == \
        ("alltoall", "fp32", 1e-3)
    deepseek = transformer_config(config(
        "--num-experts", "4", "--disable-bias-linear", "--moe-router-score-function", "sigmoid",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "2",
        "--moe-router-group-topk", "1", "--moe-shared-expert-intermediate-size", "64").model, 1)
    assert (deepseek.moe_router_score_function, deepseek.moe_router_topk_scaling_factor,
            deepseek.moe_router_num_groups, deepseek.moe_router_group_topk,
            deepseek.moe_shared_expert_intermediate_size) == ("sigmoid", 2.5, 2, 1, 64)
    assert config().training.check_for_nan
    assert config("--calculate-per-token-loss").training.per_token_loss
    assert not config("--no-check-for-nan-in-loss-and-grad").training.check_for_nan


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_centres_the_norm_weights_on_zero(normalization):
    """--apply-layernorm-1p: the weight starts at 0 and the norm scales by 1 + weight, so the
    model starts as the plain norm's and a weight w acts as 1 + w."""
    import torch
    from megatron.core.transformer import TransformerConfig

    from megatron.elastic.stage_model import TorchNorm
    job = config("--apply-layernorm-1p", "--normalization", normalization)
    assert job.model.apply_layernorm_1p
    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                           normalization=normalization)
    one_p = TorchNorm(tc, 8, 1e-5, zero_centered=True)
    plain = TorchNorm(tc, 8, 1e-5)
    x = torch.randn(3, 8)
    assert torch.equal(one_p.weight, torch.zeros(8))
    torch.testing.assert_close(one_p(x), plain(x))
    with torch.no_grad():
        one_p.weight.fill_(0.5)
        plain.weight.fill_(1.5)
    torch.testing.assert_close(one_p(x), plain(x))


def test_decoupled_lr_gives_the_embeddings_and_output_layer_their_own_schedule():
    """megatron-core's param groups: the word embeddings and the output layer (marked by
    GPTModel) on --decoupled-lr, the rest on --lr; the logged rate is the rest's."""
    import dataclasses

    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    import pretrain_gpt
    from megatron.training import trainer
    from megatron.training.training import optimizer_config, transformer_config
    from tools import profile_model
    assert "--decoupled-min-lr needs --decoupled-lr" in refusal("--decoupled-min-lr", "1e-4")
    assert "--decoupled-lr must be >= --decoupled-min-lr" in refusal(
        "--decoupled-lr", "1e-5", "--decoupled-min-lr", "1e-4")
    job = config("--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5",
                 "--untie-embeddings-and-output-weights", "--lr", "1e-3")
    owned = profile_model._setup_megatron(torch, cuda=False)
    try:
        model = dataclasses.replace(job.model, padded_vocab_size=128)
        gpt = pretrain_gpt.model_provider(model, transformer_config(model, 1), True, True,
                                          ProcessGroupCollection.use_mpu_process_groups())
        ddp = DistributedDataParallel(transformer_config(model, 1),
                                      DistributedDataParallelConfig(), gpt)
        opt = get_megatron_optimizer(optimizer_config(job.training, model), [ddp],
                                     use_gloo_process_groups=False)
    finally:
        profile_model._teardown_megatron(owned)
    decoupled = {id(p) for g in opt.param_groups if not g["default_config"] for p in g["params"]}
    assert decoupled == {id(gpt.embedding.word_embeddings.weight), id(gpt.output_layer.weight)}
    assert {(g["max_lr"], g["min_lr"]) for g in opt.param_groups if not g["default_config"]} \
        == {(5e-4, 4.5e-5)}
    groups = [{"lr": 5e-4, "default_config": False}, {"lr": 1e-3, "default_config": True}]
    assert trainer._logged_lr(groups) == 1e-3


def test_the_fusion_flags_hold_as_given():
    """Megatron-LM's recipes switch fusions off; here every one but the cross entropy's
    (--cross-entropy-loss-fusion) is off already."""
    from megatron.training.training import transformer_config
    flags = ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
             "--accumulate-allreduce-grads-in-fp32", "--no-persist-layer-norm"]
    for job in (config(), config(*flags)):
        tc = transformer_config(job.model, 1)
        assert not (tc.masked_softmax_fusion or tc.bias_activation_fusion or
                    tc.bias_dropout_fusion or tc.apply_rope_fusion or
                    tc.gradient_accumulation_fusion or tc.persist_layer_norm)
        assert not job.training.grad_reduce_in_bf16         # gradients reduced in fp32


def test_uneven_first_and_last_stages_make_the_plan():
    from megatron.training.training import make_plan
    job = config("--num-layers", "8", "--pipeline-model-parallel-size", "3",
                 "--decoder-first-pipeline-num-layers", "2",
                 "--decoder-last-pipeline-num-layers", "2", world=6)
    plan = make_plan(job)
    assert [[(st.layer_start, st.layer_end) for st in p.stages] for p in plan.pipelines] == \
        [[(0, 2), (2, 6), (6, 8)]] * 2
    first = make_plan(config("--num-layers", "7", "--pipeline-model-parallel-size", "2",
                             "--decoder-first-pipeline-num-layers", "3", world=2))
    assert [(st.layer_start, st.layer_end) for st in first.pipelines[0].stages] == \
        [(0, 3), (3, 7)]
    for pp, extra, message in [
            (2, ["--decoder-first-pipeline-num-layers", "4"],
             "--decoder-first/last-pipeline-num-layers: 4 layers do not fill 2 stages with 4 "
             "on the first stage"),
            (3, ["--decoder-last-pipeline-num-layers", "1"],
             "with 1 on the last stage, the other 2 stage(s) cannot split the 3 layers left "
             "evenly"),
            (3, [], "--num-layers: number of layers 4 is not divisible by pipeline parallel "
                    "size 3")]:
        assert message in refusal("--pipeline-model-parallel-size", str(pp), *extra, world=pp)
    accounted = make_plan(config("--num-layers", "6", "--pipeline-model-parallel-size", "2",
                                 "--account-for-embedding-in-pipeline-split",
                                 "--account-for-loss-in-pipeline-split", world=2))
    assert [(st.layer_start, st.layer_end) for st in accounted.pipelines[0].stages] == \
        [(0, 3), (3, 6)]                      # 8 counted: 4 a stage, the ends 1 fewer
    embedding = make_plan(config("--num-layers", "7", "--pipeline-model-parallel-size", "2",
                                 "--account-for-embedding-in-pipeline-split", world=2))
    assert [(st.layer_start, st.layer_end) for st in embedding.pipelines[0].stages] == \
        [(0, 3), (3, 7)]
    assert "plus the 1 counted as layers must split evenly" in refusal(
        "--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split",
        world=2)
    assert "exclude each other" in refusal(
        "--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split",
        "--decoder-first-pipeline-num-layers", "1", world=2)
    assert "--chameleon-plan sets its own stages" in refusal(
        "--chameleon-plan", __file__, "--decoder-first-pipeline-num-layers", "1")


def test_distributed_optimizer_flags_reach_the_parallel_config():
    p = config("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
               "--overlap-grad-reduce", "--overlap-param-gather", world=4).parallel
    assert (p.distributed_optimizer, p.optimizer_instances, p.overlap_grad_reduce,
            p.overlap_param_gather) == (True, 2, True, True)


def test_megatron_cores_own_refusal_is_one_line():
    from tests.launch import run_script
    r = run_script([*BASE, "--num-experts", "2", "--moe-router-topk", "1",
                    "--disable-bias-linear"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: megatron-core refuses the model flags: Please use "
        "--moe-router-pre-softmax when topk is 1."]


def test_sequence_parallel_reaches_the_transformer_config():
    """--sequence-parallel with TP > 1 (off at TP 1, as in Megatron-LM), which lets a mixture of
    experts run with TP > 1; the sequence must split evenly."""
    from megatron.training.training import transformer_config
    job = config("--sequence-parallel", "--tensor-model-parallel-size", "2", world=2)
    assert job.parallel.sequence_parallel
    assert transformer_config(job.model, 2, job.parallel.sequence_parallel).sequence_parallel
    assert not config("--sequence-parallel").parallel.sequence_parallel
    assert not config("--tensor-model-parallel-size", "2", world=2).parallel.sequence_parallel
    moe = ("--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2")
    assert config(*moe, "--sequence-parallel", world=2).parallel.sequence_parallel
    assert "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel" in \
        refusal(*moe, world=2)
    assert "--sequence-parallel needs --seq-length 30 divisible by --tensor-model-parallel-size " \
        "4" in refusal("--sequence-parallel", "--tensor-model-parallel-size", "4",
                       "--seq-length", "30", world=4)


def test_tensor_parallel_needs_whole_query_groups():
    assert "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2" in refusal(
        "--group-query-attention", "--tensor-model-parallel-size", "2", world=2)


def test_num_zeros_counts_the_gradients_of_the_norm():
    """--log-num-zeros-in-grad: this rank's part, over the gradients megatron-core counts in
    the norm (each parameter once over the world), summed at the commit."""
    import torch

    from megatron.elastic import optimizer_step

    class Optimizer:
        def prepare_grads(self) -> bool:
            return False

        def get_main_grads_for_grad_norm(self):
            return [torch.tensor([0.0, 3.0, 0.0]), torch.tensor([[4.0, 0.0]])]

    parts = optimizer_step.prepare(Optimizer(), count_zeros=True)
    assert (parts.norm_sq, parts.zeros) == (25.0, 3.0)
    assert optimizer_step.prepare(Optimizer()).zeros == 0.0


def schedule_of(*flags: str):
    """The LR and weight decay megatron-core's scheduler gives each of the job's iterations
    (8 samples each: --global-batch-size 8)."""
    import torch

    from megatron.elastic.runtime import make_scheduler
    from megatron.training.trainer import scheduler_settings
    training = config("--global-batch-size", "8", "--train-iters", "10", "--lr", "1.0",
                      "--min-lr", "0.1", *flags).training
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    sched = make_scheduler(opt, scheduler_settings(training))
    out = []
    for _ in range(training.train_iters):
        sched.step(increment=training.global_batch_size)
        out.append((round(opt.param_groups[0]["lr"], 6),
                    round(opt.param_groups[0]["weight_decay"], 6)))
    return out


def test_wsd_and_the_weight_decay_increment_follow_megatron_lms_schedule():
    """WSD: the LR stays at --lr until the annealing phase (the last --lr-wsd-decay-iters of
    the decay span), then goes linearly to --min-lr; the weight decay goes linearly from
    --start-weight-decay to --end-weight-decay over the training span."""
    steps = schedule_of("--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear",
                        "--lr-wsd-decay-iters", "4", "--weight-decay-incr-style", "linear",
                        "--start-weight-decay", "0.0", "--end-weight-decay", "0.1")
    assert [lr for lr, _ in steps] == [1.0] * 6 + [0.775, 0.55, 0.325, 0.1]
    assert [wd for _, wd in steps] == pytest.approx([0.01 * i for i in range(1, 11)])
    samples = config("--global-batch-size", "8", "--train-samples", "80", "--lr-decay-samples",
                     "64", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "32",
                     "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0",
                     "--end-weight-decay", "0.1").training
    assert (samples.wsd_samples, samples.schedule_samples()[1], samples.wd_incr_samples) == \
        (32, 64, 80)
    constant = schedule_of("--weight-decay", "0.05")
    assert {wd for _, wd in constant} == {0.05}


def test_the_loss_scaling_and_fusion_flags_reach_megatron_core(monkeypatch):
    from megatron.training import arguments
    from megatron.training.training import optimizer_config, transformer_config
    job = config("--cross-entropy-loss-fusion", "--deterministic-mode", "--ddp-bucket-size",
                 "1000", "--timing-log-option", "all", "--tensorboard-dir", "tb",
                 "--tensorboard-log-interval", "5", "--tensorboard-queue-size", "1",
                 "--log-world-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--no-log-loss-scale-to-tensorboard", "--rerun-mode", "disabled")
    tc = transformer_config(job.model, 1)
    assert (tc.cross_entropy_loss_fusion, tc.cross_entropy_fusion_impl,
            tc.deterministic_mode) == (True, "native", True)
    assert job.parallel.ddp_bucket_size == 1000
    assert config("--num-dataset-builder-threads", "2").data.builder_threads == 2
    log = job.logging
    assert (log.timing_log_option, log.tensorboard_log_interval, log.tensorboard_queue_size,
            log.log_world_size, log.log_validation_ppl, log.log_loss_scale) == \
        ("all", 5, 1, True, True, False)
    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)   # --fp16 needs CUDA
    fp16 = config("--fp16", "--initial-loss-scale", "65536", "--min-loss-scale", "2",
                  "--loss-scale-window", "100", "--hysteresis", "3").training
    oc = optimizer_config(fp16, config().model)
    assert (oc.initial_loss_scale, oc.min_loss_scale, oc.loss_scale_window, oc.hysteresis) == \
        (65536, 2, 100, 3)


def test_a_checkpoints_schedule_must_match_the_flags_unless_told_which_wins():
    """Megatron-LM's default: resuming with another LR schedule is an error naming both ways
    out; --override-opt_param-scheduler takes the flags', --use-checkpoint-opt_param-scheduler
    the checkpoint's."""
    import torch

    from megatron.elastic.runtime import make_scheduler
    from megatron.training.checkpointing import schedule_mismatch
    from megatron.training.trainer import scheduler_settings

    def scheduler(*flags: str):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        return make_scheduler(opt, scheduler_settings(config(*flags).training))

    saved = scheduler("--lr", "0.01").state_dict()
    assert schedule_mismatch(scheduler("--lr", "0.01"), saved) is None
    line = schedule_mismatch(scheduler("--lr", "0.02"), saved)
    assert line.startswith("its learning rate is 0.01, the flags give 0.02: pass "
                           "--override-opt_param-scheduler")
    assert schedule_mismatch(scheduler("--lr", "0.02", "--train-iters", "40"), saved)
    assert schedule_mismatch(scheduler("--lr", "0.02", "--override-opt_param-scheduler"),
                             saved) is None
    kept = scheduler("--lr", "0.02", "--use-checkpoint-opt_param-scheduler")
    assert schedule_mismatch(kept, saved) is None
    kept.load_state_dict(saved)
    assert kept.max_lr == 0.01


def test_the_fused_cross_entropy_gives_the_unfused_losses_and_bf16_gradients():
    """--cross-entropy-loss-fusion: megatron-core's native fused kernel (compiled at its first
    call) gives the unfused per-token losses; its gradient comes back in bf16, as the kernel
    returns it for the bf16 training it is written for."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from tools import profile_model
    owned = profile_model._setup_megatron(torch, cuda=False)
    try:
        logits = torch.randn(16, 2, 128, generator=torch.Generator().manual_seed(0))
        labels = torch.randint(0, 128, (16, 2), generator=torch.Generator().manual_seed(1))
        out = []
        for loss_of in (lambda x: vocab_parallel_cross_entropy(x, labels),
                        lambda x: fused_vocab_parallel_cross_entropy(
                            x, labels, parallel_state.get_tensor_model_parallel_group())):
            x = logits.clone().requires_grad_(True)
            loss = loss_of(x)
            loss.sum().backward()
            out.append((loss.detach(), x.grad))
    finally:
        profile_model._teardown_megatron(owned)
    (plain, plain_grad), (fused, fused_grad) = out
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, plain_grad.to(torch.bfloat16).float(), rtol=1e-2,
                               atol=1e-6)
    assert not torch.equal(fused_grad, plain_grad)


def test_tensorboard_gets_megatron_lms_scalars_at_its_interval(tmp_path, capsys):
    """--tensorboard-log-interval 2 writes iterations 2 and 4; --log-world-size-to-tensorboard
    the world's size (it changes with losses and rejoins); --log-validation-ppl-to-tensorboard
    the perplexity; --no-log-loss-scale-to-tensorboard no loss scale; --log-params-norm's norm
    goes to the iteration line and to tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from chameleon_ext.plan.execution_plan import ExecutionPlan
    from megatron.elastic.schedules import StepResult
    from megatron.training.reporting import Reporter
    log = config("--tensorboard-dir", str(tmp_path), "--tensorboard-log-interval", "2",
                 "--log-world-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--no-log-loss-scale-to-tensorboard", "--log-params-norm",
                 "--no-progress-bar").logging
    reporter = Reporter(log, train_iters=4, seq_length=32, lead=True)
    plan = ExecutionPlan.failure_free(2, 1, 1, 4, 2, 4)
    for it in range(1, 5):
        reporter.iteration(it, StepResult(2.0, 1.0, True, 4), 100.0, 4 * it, plan, "auto",
                           1e-3, lambda: "", loss_scale=lambda: 1.0, params_norm=12.5)
    reporter.validation(4, math.log(8.0))
    reporter.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("world-size")] == [2, 4]
    assert {e.value for e in events.Scalars("world-size")} == {2}
    assert [e.value for e in events.Scalars("params-norm")] == [12.5, 12.5]
    assert events.Scalars("lm loss validation ppl")[0].value == pytest.approx(8.0)
    assert "loss-scale" not in tags and "batch-size" in tags
    assert capsys.readouterr().out.count(" params norm: 12.500 |") == 4


def test_replica_digests_name_the_tensors_whose_copies_differ():
    from megatron.training.reporting import differing
    assert differing([{"w": "a", "w#exp_avg": "b"}, {"w": "a", "w#exp_avg": "b"}]) == []
    assert differing([{"w": "a", "v": "c"}, {"w": "x", "v": "c"}, {"v": "d"}]) == ["v", "w"]
    assert "--check-weight-hash-across-dp-replicas-interval must be at least 1" in refusal(
        "--check-weight-hash-across-dp-replicas-interval", "0")
    assert config("--check-weight-hash-across-dp-replicas-interval", "5"
                  ).training.check_replicas_interval == 5


def test_interleaved_pipeline_flags_make_the_plan():
    """--num-layers-per-virtual-pipeline-stage 1 of 4 layers over 2 stages: 2 chunks a rank;
    a pipeline's micro-batches must be a multiple of its ranks (Megatron-LM's interleaved
    schedule)."""
    from megatron.training.training import make_plan
    job = config("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                 "1", "--global-batch-size", "8", world=4)
    assert job.parallel.virtual_stages == 2
    plan = make_plan(job)
    assert plan.interleaved and plan.chunks(0) == [0, 2] and len(plan.pipelines) == 2
    assert "an interleaved pipeline of 2 stages runs a multiple of 2 micro-batches: " \
           "--global-batch-size 6 gives each of the 1 pipeline(s) 3" in refusal(
               "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-model-parallel-size",
               "2", "--global-batch-size", "6", world=2)


def test_an_interleaved_plan_file_is_refused_under_chameleon(tmp_path):
    from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError
    from megatron.training.training import make_plan
    path = tmp_path / "plan.json"
    ExecutionPlan.failure_free(2, 1, 2, 4, 2, 4, virtual_stages=2).save(path)
    assert make_plan(config("--chameleon-plan", str(path), world=2)).interleaved
    with pytest.raises(PlanError, match="--chameleon recovers plans of one stage per rank"):
        make_plan(config("--chameleon-plan", str(path), "--chameleon", world=2))
