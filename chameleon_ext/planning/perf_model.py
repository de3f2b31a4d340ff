"""Chameleon's unified performance model: a profile of one model on one kind of hardware, and the
predicted iteration time, memory and transition cost of any execution plan.

A Profile holds per-micro-batch costs of one transformer layer (forward, input-gradient and
weight-gradient halves of the backward), of the embedding and of the output layer with its loss,
the optimizer's cost per parameter, alpha + bytes/beta models of point-to-point messages and of the
gradient all-reduce, and memory per parameter and per in-flight activation. It is either measured
(from the Megatron timers of a running job, megatron.elastic.calibration), measured offline
(tools/profile_model.py), or analytical (FLOPs over peak FLOP/s, bytes over link bandwidth;
`analytical_profile`), and says which in `source`.

Prediction = the simulator run over the plan's schedule IR with the profile's costs (ProfileCosts):
the same op lists the executor runs. `predict_plan` takes the schedule the executor would run and
simulates only the pipelines that determine the result, exactly (the planner's fast path). Ranks
that share compute (several CPU processes on fewer cores) are modelled as sharing a device: a
host's `cores` are divided among the ranks placed on it, so per-op times grow by ranks / cores
when there are more ranks than cores. With tensor parallelism each rank is one shard: its ops
cost the profile's compute split over the shards plus the all-reduces Megatron's layers do
inside them, over the group's (intra-node) link (Profile.at_tensor_parallel); its memory is its
shard of the stage's state and activations; and a group runs at its slowest rank's pace.

This module imports only the standard library and chameleon_ext: never torch or megatron.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.plan.sharding import optimizer_shards
from chameleon_ext.schedule.choice import choose_schedule
from chameleon_ext.schedule.ir import COMPUTE, Op, OpKind, Schedule
from chameleon_ext.schedule.simulator import SimResult, reduction_components, simulate

SOURCES = ("measured", "offline", "analytical")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE = ("", "full", "selective")
SHARING_ROUNDS = 20
MIB = 2 ** 20


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says why."""


@dataclass(frozen=True)
class ModelShape:
    """The GPT configuration a profile describes (megatron-core GPTModel, local layer spec).
    The fields after bytes_per_element are Megatron-LM's model flags; their defaults are GPT-2's
    shapes, which profiles written before them describe. A field equal to its default's value
    is stored as the default (__post_init__), so equal models compare equal however given.
    Frozen, so hashable: stage_param_count caches by it."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    vocab_size: int
    ffn_hidden_size: int = 0          # 0: 4 x hidden_size
    bytes_per_element: int = 4        # activations and messages (fp32 on CPU, 2 for bf16)
    num_query_groups: int = 0         # --num-query-groups (GQA); 0: one per head
    kv_channels: int = 0              # --kv-channels; 0: hidden_size / heads
    gated_linear_unit: bool = False   # --swiglu: fc1 gives [gate, up], fc2 takes ffn
    add_bias_linear: bool = True      # not --disable-bias-linear
    tied_embeddings: bool = True      # not --untie-embeddings-and-output-weights
    learned_positions: bool = True    # --position-embedding-type learned_absolute (not rope)
    max_position_embeddings: int = 0  # 0: seq_length
    normalization: str = "LayerNorm"  # or RMSNorm (a weight, no bias)
    qk_layernorm: bool = False        # a norm over each head's queries and keys
    num_experts: int = 0              # --num-experts: 0 is a dense MLP (MoE: expert parallel 1)
    moe_ffn_hidden_size: int = 0      # 0: ffn_hidden_size
    moe_router_topk: int = 0          # experts per token (0 without experts)
    moe_shared_ffn: int = 0           # --moe-shared-expert-intermediate-size: an MLP every
                                      # token also passes (0: none)
    recompute: str = ""               # --recompute-granularity: "", full (uniform, 1 layer)
                                      # or selective (core attention)

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ProfileError(f"model normalization {self.normalization!r} is not one of "
                               f"{', '.join(NORMALIZATIONS)}")
        if self.recompute not in RECOMPUTE:
            raise ProfileError(f"model recompute {self.recompute!r} is not one of "
                               f"{', '.join(repr(r) for r in RECOMPUTE)}")
        h, a = self.hidden_size, self.num_attention_heads

        def default(name: str) -> None:
            object.__setattr__(self, name, 0)   # frozen: the normal form, set once here

        if self.ffn_hidden_size == 4 * h:
            default("ffn_hidden_size")
        if self.num_query_groups == a:
            default("num_query_groups")
        if a and self.kv_channels * a == h:
            default("kv_channels")
        if self.max_position_embeddings == self.seq_length:
            default("max_position_embeddings")
        if not self.num_experts:
            for name in ("moe_ffn_hidden_size", "moe_router_topk", "moe_shared_ffn"):
                default(name)
        elif self.moe_ffn_hidden_size == self.ffn:
            default("moe_ffn_hidden_size")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_width(self) -> int:
        """All heads' queries of one token (hidden_size unless kv_channels says otherwise)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """One token's keys (or values): one head per query group."""
        return (self.num_query_groups or self.num_attention_heads) * self.head_dim

    @property
    def ffn_matrices(self) -> int:
        """Weight matrices of one MLP: fc1 (gate and up when gated) and fc2."""
        return 3 if self.gated_linear_unit else 2

    def _norm_params(self, width: int) -> int:
        return width * (1 if self.normalization == "RMSNorm" else 2)

    def _mlp_params(self, ffn: int) -> int:
        h = self.hidden_size
        up = ffn * (self.ffn_matrices - 1)  # fc1's outputs
        return h * up + ffn * h + self.add_bias_linear * (up + h)

    def layer_params(self) -> int:
        """Attention (QKV + projection, the query and key norms), the MLP (or the router and
        every expert's MLP) and two norms, per megatron-core's local layer spec."""
        h, bias = self.hidden_size, self.add_bias_linear
        q, kv = self.query_width, self.kv_width
        attention = h * (q + 2 * kv) + q * h + bias * (q + 2 * kv + h) \
            + self.qk_layernorm * 2 * self._norm_params(self.head_dim)
        if self.num_experts:
            mlp = self.num_experts * (h + bias + self._mlp_params(self.moe_ffn))
            if self.moe_shared_ffn:
                mlp += self._mlp_params(self.moe_shared_ffn)
        else:
            mlp = self._mlp_params(self.ffn)
        return attention + mlp + 2 * self._norm_params(h)

    def embedding_params(self) -> int:
        """Word embeddings, and learned position embeddings (RoPE has no parameters)."""
        positions = self.learned_positions * (self.max_position_embeddings or self.seq_length)
        return (self.vocab_size + positions) * self.hidden_size

    def output_params(self, first: bool) -> int:
        """The last stage's output layer: its own weights when untied, else a copy of the word
        embedding unless this stage (`first`) holds it already."""
        return (not self.tied_embeddings or not first) * self.vocab_size * self.hidden_size

    def head_params(self, first: bool) -> int:
        """The last stage's final norm and output layer."""
        return self._norm_params(self.hidden_size) + self.output_params(first)

    def message_bytes(self) -> int:
        """One activation or its gradient between stages: [seq, micro batch, hidden]."""
        return self.seq_length * self.micro_batch_size * self.hidden_size * self.bytes_per_element

    def layer_activation_bytes(self) -> int:
        """What one layer keeps for the backward of one micro-batch, after Korthikanti et al.
        2022: s*b*h*(34 + 5*a*s/h) bytes at 2-byte precision (1-byte dropout masks), scaled to
        bytes_per_element. Term by term, per token at 2 bytes: attention 11h (its input 2h, Q
        2q, K and V 2kv each, the projection's input 2q, a dropout mask h; with qk-layernorm
        the norms' inputs 2q + 2kv), the MLP 19h (its input 2h, fc1's output and the
        activation's 2f each, a gated fc1 4f, a dropout mask h; MoE: the router's input and
        logits, and fc1's input and outputs for each of the top-k copies of the token), the
        norms 4h; and 5*a*s per head and token of attention scores (softmax output, its
        dropout mask and output). Selective recompute drops the scores, full recompute keeps
        only the layer's input."""
        s, b, h = self.seq_length, self.micro_batch_size, self.hidden_size
        if self.recompute == "full":
            return s * b * h * self.bytes_per_element
        q, kv = self.query_width, self.kv_width
        attention = 3 * h + 4 * q + 4 * kv + self.qk_layernorm * 2 * (q + kv)
        if self.num_experts:
            mlp = 3 * h + 2 * self.num_experts + self.moe_router_topk * (
                2 * h + 2 * self.moe_ffn * self.ffn_matrices) \
                + 2 * self.moe_shared_ffn * self.ffn_matrices
        else:
            mlp = 3 * h + 2 * self.ffn * self.ffn_matrices
        scores = 0 if self.recompute == "selective" else 5 * self.num_attention_heads * s
        return s * b * (attention + mlp + 4 * h + scores) * self.bytes_per_element // 2

    def _score_flops(self) -> float:
        """Q K^T and the scores times V: each query head over the whole sequence."""
        return 4.0 * self.micro_batch_size * self.seq_length ** 2 * self.query_width

    def layer_flops(self) -> float:
        """Forward FLOPs of one layer for one micro-batch (matmuls and attention scores; MoE:
        the router and each token's top-k experts)."""
        s, b, h = self.seq_length, self.micro_batch_size, self.hidden_size
        q, kv = self.query_width, self.kv_width
        if self.num_experts:
            mlp = h * self.num_experts + self.ffn_matrices * h * (
                self.moe_router_topk * self.moe_ffn + self.moe_shared_ffn)
        else:
            mlp = self.ffn_matrices * h * self.ffn
        return 2.0 * s * b * (h * (q + 2 * kv) + q * h + mlp) + self._score_flops()

    def layer_recompute_flops(self) -> float:
        """Forward FLOPs one layer's backward runs again: the whole forward under full
        recompute, the core attention under selective."""
        if self.recompute == "full":
            return self.layer_flops()
        return self._score_flops() if self.recompute == "selective" else 0.0

    def head_flops(self) -> float:
        """Forward FLOPs of the output layer (logits over the vocabulary)."""
        return 2.0 * self.seq_length * self.micro_batch_size * self.hidden_size * self.vocab_size


@dataclass(frozen=True)
class Profile:
    """Costs in milliseconds (per micro-batch for compute), bytes for memory. See the module
    docstring; `cores` > 0 means ranks on one host share that many cores (CPU). Frozen: a
    changed profile is a new one (dataclasses.replace), so its cost_key never goes stale."""

    source: str
    device: str
    shape: ModelShape
    layer_fwd_ms: float
    layer_bwd_input_ms: float
    layer_bwd_weight_ms: float
    embedding_fwd_ms: float
    embedding_bwd_ms: float
    head_fwd_ms: float                 # output layer and loss
    head_bwd_ms: float
    optimizer_ms_per_mparam: float     # optimizer step per million parameters of a rank
    p2p_alpha_ms: float
    p2p_ms_per_mib: float
    allreduce_alpha_ms: float          # per step of a ring all-reduce
    allreduce_ms_per_mib: float        # per MiB crossing one link
    bytes_per_param: int = 16          # parameter + fp32 main grad + two Adam moments
    # How the job holds its optimizer state: the distributed optimizer's instances
    # (--num-distributed-optimizer-instances; 0: replicated whole, not sharded), and whether
    # each shard has a buddy copy (--chameleon-shard-redundancy buddy). A sharded rank steps
    # and holds its shard of what sharded_bytes_per_param counts (optimizer_params). With
    # --overlap-grad-reduce megatron-core reduces gradients in buckets (grad_buckets), and a
    # buddy copy's gradient message of one bucket runs beside the next bucket's reduction.
    optimizer_instances: int = 0
    buddy_copies: bool = False
    overlap_grad_reduce: bool = False
    device_memory_bytes: int = 0       # per rank; 0: not limited
    cores: float = 0.0
    ranks_per_host: int = 0            # 0: all ranks on one host (with cores > 0)
    detect_ms: float = 50.0            # transition costs: failure to notice
    rebuild_ms: float = 400.0          # notice to a new runtime (groups, model, optimizer)
    load_ms_per_mib: float = 1.0       # reading a checkpoint
    # measured iteration time the simulated ops do not cover (with `cores`: at a core to
    # itself; a plan's ranks slow it by their mean sharing, perf_model.overhead_ms)
    iteration_overhead_ms: float = 0.0
    # host time around each forward or backward op that the costs above leave out (an
    # emulated device's: the executor's own work between the ops it pads to the device's
    # time), fitted to a measured failure-free iteration (tools/reproduce/executed.py)
    op_overhead_ms: float = 0.0
    # eager redundancy's measured refresh over its point-to-point estimate (the wait for a
    # slower owner included)
    shadow_sync_factor: float = 1.0
    # What one micro-batch's forward keeps for its backward, measured (0: the layers' from
    # ModelShape.layer_activation_bytes, none for the embedding and the head)
    layer_activation_bytes: int = 0
    embedding_activation_bytes: int = 0
    head_activation_bytes: int = 0
    # Tensor parallelism. The compute costs above are per shard of a layer split
    # `tensor_parallel` ways, the tensor-parallel all-reduces inside each op included (what the
    # timers of a job at that degree measure; analytical and offline profiles: 1, a whole
    # layer). A plan of another degree is costed by at_tensor_parallel: the compute split
    # evenly, plus the all-reduces of the activations (sequence x micro-batch x hidden) that
    # Megatron's layers do (2 in each transformer layer's forward and 2 in its backward's input
    # half, 1 in the vocabulary-parallel embedding's forward and 1 in the output layer's
    # backward) as ring all-reduces over the group's link: intra-node (NVLink), `tp_alpha_ms`
    # + `tp_ms_per_mib` per step.
    tensor_parallel: int = 1
    tp_alpha_ms: float = 0.0
    tp_ms_per_mib: float = 0.0
    # The calibration hook: one of those all-reduces at `tensor_parallel`, measured (the live
    # calibration fills it from the timed collectives of the job's tensor-parallel group);
    # negative: from the link parameters above, analytically.
    tp_allreduce_ms: float = -1.0
    # rank -> how many times slower it computes than the costs above (a slow device); ranks
    # of the plan the profile was measured under. A tensor-parallel group runs at the pace of
    # its slowest rank (lockstep_slowdown).
    rank_slowdown: dict[int, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ProfileError(f"profile source {self.source!r} is not one of {', '.join(SOURCES)}")
        if self.tensor_parallel < 1:
            raise ProfileError(f"profile tensor_parallel {self.tensor_parallel} is below 1")

    def tp_allreduce(self, tensor_parallel: int) -> float:
        """One all-reduce of a layer's activations over a tensor-parallel group of that size:
        the measured one at the profile's own degree when there is one, else the ring over the
        group's link."""
        if tensor_parallel == self.tensor_parallel and self.tp_allreduce_ms >= 0:
            return self.tp_allreduce_ms
        return ring_allreduce_ms(tensor_parallel, self.shape.message_bytes(), self.tp_alpha_ms,
                                 self.tp_ms_per_mib)

    def at_tensor_parallel(self, tensor_parallel: int) -> "Profile":
        """This profile's costs for the shards of a plan of `tensor_parallel` (itself at its own
        degree): each op's compute without its all-reduces, split evenly over the shards, plus
        the all-reduces at the new degree (see the fields). Memory per shard is the plan's
        concern (stage_param_count, _memory)."""
        if tensor_parallel == self.tensor_parallel:
            return self
        was, now = self.tp_allreduce(self.tensor_parallel), self.tp_allreduce(tensor_parallel)
        scale = self.tensor_parallel / tensor_parallel

        def shard(ms: float, allreduces: int) -> float:
            return max(0.0, ms - allreduces * was) * scale + allreduces * now

        return replace(
            self, tensor_parallel=tensor_parallel, tp_allreduce_ms=now,
            layer_fwd_ms=shard(self.layer_fwd_ms, 2),
            layer_bwd_input_ms=shard(self.layer_bwd_input_ms, 2),
            layer_bwd_weight_ms=shard(self.layer_bwd_weight_ms, 0),
            embedding_fwd_ms=shard(self.embedding_fwd_ms, 1),
            embedding_bwd_ms=shard(self.embedding_bwd_ms, 0),
            head_fwd_ms=shard(self.head_fwd_ms, 0), head_bwd_ms=shard(self.head_bwd_ms, 1))

    def to_dict(self) -> dict:
        # field by field: dataclasses.asdict's deep copies were most of a cached prediction's
        # time (predict_plan keys its cache with this)
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(shape=asdict(self.shape), rank_slowdown=dict(self.rank_slowdown),
                 notes=list(self.notes))
        return d

    @functools.cached_property
    def cost_key(self) -> str:
        """Every cost as one JSON string, without the slow ranks (named by their plan's ranks)
        and the notes (words, not costs: a recalibration adds to them): predict_plan's cache
        key, built once per profile instead of once per prediction."""
        d = self.to_dict()
        del d["rank_slowdown"], d["notes"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        try:
            d = dict(d)
            d["shape"] = ModelShape(**d["shape"])
            d["rank_slowdown"] = {int(r): float(f) for r, f in d.get("rank_slowdown", {}).items()}
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise ProfileError(f"not a Chameleon profile: {e}") from None

    def save(self, path: str | Path) -> None:
        """Atomically (a reader never sees half a file)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise ProfileError(f"cannot read profile {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {path} is not JSON: {e}") from None

    def for_survivors(self, lost: set[int]) -> "Profile":
        """This profile for a plan over the ranks not in `lost` (with tensor parallelism: every
        rank of a group with a lost one, ExecutionPlan.survivors): slow ranks renumbered densely
        in their old order, as every strategy renumbers the ranks it keeps."""
        if not self.rank_slowdown:
            return self
        return replace(self, rank_slowdown={
            r - sum(1 for x in lost if x < r): f
            for r, f in self.rank_slowdown.items() if r not in lost})

    def sharing(self, computing: float) -> float:
        """How much slower each rank computes while `computing` ranks (on average) share the
        host's cores."""
        if self.cores <= 0:
            return 1.0
        return max(1.0, computing / self.cores)

    def hosts(self, ranks: list[int]) -> list[list[int]]:
        """The ranks on each host (they fill hosts in rank order)."""
        per = self.ranks_per_host or len(ranks) or 1
        return [ranks[i:i + per] for i in range(0, len(ranks), per)]

    def host_load(self, plan: ExecutionPlan) -> dict[int, float]:
        """rank -> its sharing factor under `plan` when every rank computes all the time."""
        return {r: self.sharing(len(h)) for h in self.hosts(plan.ranks) for r in h}

    def concurrent_load(self, ranks: list[int],
                        timeline: dict[int, list[tuple[Op, float, float]]]) -> dict[int, float]:
        """rank -> the mean, over its compute, of max(1, ranks of its host computing at that
        moment / cores): how much sharing the cores slows it (a rank waiting on a message
        sleeps and leaves its core to the others)."""
        load = {}
        for host in self.hosts(ranks):
            events = sorted((t, inc, r) for r in host for op, start, end in timeline[r]
                            if op.kind in COMPUTE and end > start
                            for t, inc in ((start, 1), (end, -1)))
            active: set[int] = set()
            weighted = {r: 0.0 for r in host}
            span = {r: 0.0 for r in host}
            last = 0.0
            for t, inc, r in events:  # ends sort before starts at the same instant
                if active and t > last:
                    f = self.sharing(len(active))
                    for q in active:
                        weighted[q] += f * (t - last)
                        span[q] += t - last
                last = t
                (active.add if inc > 0 else active.discard)(r)
            load.update({r: weighted[r] / span[r] if span[r] else 1.0 for r in host})
        return load


class ProfileCosts:
    """The simulator's CostModel from a Profile, for one plan: `load` is each rank's sharing
    factor (default: every rank of a host computing all the time); `part_of` is the plan that
    `plan` is a part of (predict_plan): each reduction is costed for its group there, and the
    parameters are counted under its tensor parallelism."""

    def __init__(self, plan: ExecutionPlan, profile: Profile, *,
                 part_of: ExecutionPlan | None = None,
                 load: dict[int, float] | None = None) -> None:
        tp = (part_of or plan).tensor_parallel
        self.profile = profile = profile.at_tensor_parallel(tp)
        self.load = load or profile.host_load(plan)
        self._slow = lockstep_slowdown(part_of or plan, profile.rank_slowdown)
        self._stage: dict[int, tuple[int, bool, bool]] = {
            r: (plan.stage_of(r).num_layers, plan.is_first_stage(r), plan.is_last_stage(r))
            for r in plan.ranks}
        # an interleaved plan's ops name their stage: (layers, first, last) of each
        self._chunk: dict[tuple[int, int], tuple[int, bool, bool]] = {}
        if plan.interleaved:
            for r in plan.ranks:
                stages = plan.pipeline_of(r).stages
                self._chunk.update(((r, s), (stages[s].num_layers, s == 0,
                                             s == len(stages) - 1)) for s in plan.chunks(r))
        self._params = {r: stage_params(plan, r, profile.shape, tp) for r in plan.ranks}
        whole = part_of or plan
        shards = optimizer_shards(whole, profile.optimizer_instances)
        self._stepped = {r: self._params[r] * step_share(shards[r], profile.buddy_copies)
                         for r in plan.ranks}
        # A buddy's copy steps from its owner's shard gradient, sent before the commit: a
        # bucket's part once the bucket is reduced, to the previous rank of the ring, so on
        # full-duplex links it crosses each link the other way than the ring's reduction of
        # the next bucket; the tied embedding's part goes after its sum over the first and
        # last stages (buddy_message_ms).
        self._buddy_ms = {r: buddy_message_ms(
            profile, self._params[r], shards[r],
            profile.shape.vocab_size * profile.shape.hidden_size / tp   # one end of a pipeline
            if profile.shape.tied_embeddings and self._stage[r][1] != self._stage[r][2] else 0.0)
            for r in plan.ranks if profile.buddy_copies and shards[r] > 1}
        self._segments = _segment_costs(plan, whole, profile) \
            if whole.misaligned_stages() is not None else {}
        self._group_sizes: dict[int, int] = {}
        if part_of is not None:
            held: dict[tuple[int, int], int] = {}  # stages with ranks per layer range
            for p in part_of.pipelines:
                for st in p.stages:
                    if st.ranks:
                        key = (st.layer_start, st.layer_end)
                        held[key] = held.get(key, 0) + 1
            self._group_sizes = {r: held[st.layer_start, st.layer_end]
                                 for p in plan.pipelines for st in p.stages for r in st.ranks}
        self._msg_ms = profile.p2p_alpha_ms + profile.p2p_ms_per_mib * \
            profile.shape.message_bytes() / MIB

    def compute(self, rank: int, op: Op) -> float:
        p = self.profile
        n, first, last = self._stage[rank] if op.stage < 0 else self._chunk[rank, op.stage]
        kind = op.kind
        if kind is OpKind.FWD:
            ms = n * p.layer_fwd_ms + first * p.embedding_fwd_ms + last * p.head_fwd_ms
        elif kind is OpKind.BWD:
            ms = n * (p.layer_bwd_input_ms + p.layer_bwd_weight_ms) + first * p.embedding_bwd_ms \
                + last * p.head_bwd_ms
        elif kind is OpKind.BWD_INPUT:  # the output layer's gradient is on the critical path
            ms = n * p.layer_bwd_input_ms + last * p.head_bwd_ms
        elif kind is OpKind.BWD_WEIGHT:
            ms = n * p.layer_bwd_weight_ms + first * p.embedding_bwd_ms
        elif kind is OpKind.OPT_STEP:
            return p.optimizer_ms_per_mparam * self._stepped[rank] / 1e6 * self.load[rank] * \
                self._slow.get(rank, 1.0)
        else:
            raise ValueError(f"rank {rank}, {op}: compute() is only defined for fwd, bwd, "
                             "bwd_input, bwd_weight and optimizer_step")
        return (ms * self._slow.get(rank, 1.0) + p.op_overhead_ms) * self.load[rank]

    def p2p(self, src: int, dst: int, op: Op) -> float:
        return self._msg_ms

    def reduce(self, ranks: tuple[int, ...]) -> float:
        if self._segments:  # one all-reduce per segment of layers, one after the other
            return self._segments.get(ranks, 0.0)
        return allreduce_ms(self.profile, self._group_sizes.get(ranks[0], len(ranks)),
                            self._params[ranks[0]] * 4) + \
            self._buddy_ms.get(ranks[0], 0.0)  # fp32 main grads; a group's shards are alike


def _segment_costs(plan: ExecutionPlan, whole: ExecutionPlan,
                   profile: Profile) -> dict[tuple[int, ...], float]:
    """Each chain of a misaligned plan's gradient all-reduces (simulator.reduction_components)
    -> its duration in `whole` (the plan, or the one it is a part of, whose chains hold its
    chains' ranks and their twins): every segment's all-reduce over the ranks holding it, in
    turn."""
    shape, tp = profile.shape, whole.tensor_parallel
    chain = reduction_components(whole)
    stages = [st for p in whole.pipelines for st in p.stages if st.ranks]
    total: dict[tuple[int, ...], float] = {}
    for a, b in whole.segments():
        holders = [st for st in stages if st.layer_start <= a and b <= st.layer_end]
        n = (b - a) * shape.layer_params() + (a == 0) * shape.embedding_params()
        ms = allreduce_ms(profile, len(holders), 4 * n // tp)
        for t in range(tp):
            group = chain[holders[0].ranks[t]]
            total[group] = total.get(group, 0.0) + ms
    by_rank = {r: ms for group, ms in total.items() for r in group}
    return {group: by_rank[group[0]] for group in set(reduction_components(plan).values())}


def allreduce_ms(profile: Profile, group: int, nbytes: int) -> float:
    """The data-parallel gradient all-reduce of `nbytes` over `group` ranks."""
    return ring_allreduce_ms(group, nbytes, profile.allreduce_alpha_ms,
                             profile.allreduce_ms_per_mib)


def ring_allreduce_ms(group: int, nbytes: int, alpha_ms: float, ms_per_mib: float) -> float:
    """Ring all-reduce: 2 (n - 1) steps, each moving nbytes / n over one link."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) * (alpha_ms + ms_per_mib * nbytes / group / MIB)


def lockstep_slowdown(plan: ExecutionPlan, slowdown: dict[int, float]) -> dict[int, float]:
    """rank -> the slowdown of its tensor-parallel group (ranks of no slowed group left out):
    its shards meet in every all-reduce inside a layer, so a group runs at its slowest rank's
    pace."""
    if not slowdown:
        return {}
    out = {}
    for p in plan.pipelines:
        for st in p.stages:
            factor = max((slowdown.get(r, 1.0) for r in st.ranks), default=1.0)
            if factor != 1.0:
                out.update((r, factor) for r in st.ranks)
    return out


def stage_params(plan: ExecutionPlan, rank: int, shape: ModelShape,
                 tensor_parallel: int | None = None) -> int:
    """Parameters on `rank` (megatron-core's count): its layers' share (tensor parallel splits
    them), the embeddings on the first stage, and on the last the final norm and the output
    layer (ModelShape.head_params); in an interleaved plan, of each of its stages."""
    stages = plan.pipeline_of(rank).stages
    tp = plan.tensor_parallel if tensor_parallel is None else tensor_parallel
    return sum(stage_param_count(shape, stages[s].num_layers, s == 0, s == len(stages) - 1, tp)
               for s in plan.chunks(rank))


@functools.lru_cache(maxsize=65536)
def stage_param_count(shape: ModelShape, layers: int, first: bool, last: bool,
                      tensor_parallel: int) -> int:
    """stage_params of a stage of `layers` layers, without a plan (the planner's bounds).
    Cached: a trace's simulation asks it hundreds of thousands of times for a few shapes."""
    total = layers * shape.layer_params() + first * shape.embedding_params() \
        + last * shape.head_params(first)
    return total // tensor_parallel


@dataclass
class Prediction:
    iteration_ms: float
    memory_bytes: dict[int, int]       # per rank: parameters, gradients, optimizer, activations
    bubble_fraction: float
    sharing: dict[int, float] = field(default_factory=dict)  # rank -> slowdown by shared cores

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.memory_bytes.values(), default=0)


def predict(plan: ExecutionPlan, schedule: Schedule, profile: Profile,
            costs: ProfileCosts | None = None, validate: bool = True,
            start: dict[int, float] | None = None) -> Prediction:
    """Iteration time and per-rank memory of running `schedule` on `plan` (validate=False:
    a schedule correct by construction, not checked again; `start`: simulator.simulate's, each
    rank's work before its first op). A rank sharing cores is slowed by how many ranks compute
    while it does, per core (Profile.concurrent_load): a fixed point, found by simulating
    again with the sharing the last simulated timeline implies."""
    if costs is None:
        costs = ProfileCosts(plan, profile)
    shared = profile.cores > 0
    res = simulate(plan, schedule, costs, timeline=shared, validate=validate, start=start)
    if shared:
        for _ in range(SHARING_ROUNDS):
            load = profile.concurrent_load(plan.ranks, res.timeline)
            if all(abs(load[r] - costs.load[r]) < 1e-4 * load[r] for r in load):
                break
            costs = ProfileCosts(plan, profile, load=load)
            res = simulate(plan, schedule, costs, timeline=True, validate=False, start=start)
    return Prediction(with_overhead(res.iteration_time, overhead_ms(profile, costs.load)),
                      _memory(plan, res, profile, plan.tensor_parallel), res.bubble_fraction,
                      dict(costs.load))


def overhead_ms(profile: Profile, load: dict[int, float]) -> float:
    """The iteration time the simulated ops do not cover (Python between ops, data loading):
    on ranks that share cores, work slowed like theirs, by the plan's mean sharing factor."""
    if profile.cores <= 0 or not load:
        return profile.iteration_overhead_ms
    return profile.iteration_overhead_ms * sum(load.values()) / len(load)


def with_overhead(simulated_ms: float, overhead: float) -> float:
    """A simulated iteration plus the overhead. A negative overhead (the calibration's: the
    simulation overshot the plan it was fitted under) takes at most half of it, as the
    calibration bounds it for that plan: fitted under a plan that simulates long, it would
    otherwise make a plan that simulates short take negative time."""
    return simulated_ms + max(overhead, -simulated_ms / 2)


def _memory(plan: ExecutionPlan, res: SimResult, profile: Profile,
            tensor_parallel: int, whole: ExecutionPlan | None = None) -> dict[int, int]:
    """Per rank: parameters, gradients and optimizer state, and the activations of the most
    micro-batches it held at once, each shard 1 / `tensor_parallel` of its stage's (measured
    activations are a shard's at the profile's degree; the activations split with sequence
    parallelism). Under the distributed optimizer a rank holds its shard of what it shards
    (sharded_bytes_per_param), over its replica group in `whole` (the plan `plan` is a part
    of), and with buddy copies its owner's shard too (moments, values and gradient)."""
    shape = profile.shape
    shards = optimizer_shards(whole or plan, profile.optimizer_instances)
    sharded = sharded_bytes_per_param(profile)
    measured = profile.tensor_parallel  # a measured shard's bytes x this: the whole stage's
    per_layer = profile.layer_activation_bytes * measured or shape.layer_activation_bytes()
    memory = {}
    for r in plan.ranks:
        # what one micro-batch in flight keeps: its stage's activations (an interleaved
        # rank's in-flight micro-batches are in its chunks: the largest of theirs)
        stages = plan.pipeline_of(r).stages
        kept = max(stages[s].num_layers * per_layer
                   + ((s == 0) * profile.embedding_activation_bytes
                      + (s == len(stages) - 1) * profile.head_activation_bytes) * measured
                   for s in plan.chunks(r))
        acts = res.peak_inflight[r] * kept // tensor_parallel
        params = stage_params(plan, r, shape, tensor_parallel)
        state = params * profile.bytes_per_param
        if shards[r] > 1:
            state -= params * sharded * (shards[r] - 1) // shards[r]
            if profile.buddy_copies:
                state += params * (sharded + 8) // shards[r]
        memory[r] = state + acts
    return memory


def sharded_bytes_per_param(profile: Profile) -> int:
    """What the distributed optimizer shards of a parameter's bytes: Adam's two moments, and
    with 16-bit parameters their fp32 main copy (the parameter and its fp32 main gradient stay
    whole on every replica)."""
    return profile.bytes_per_param - profile.shape.bytes_per_element - 4


def step_share(shards: int, buddy: bool) -> float:
    """The part of its stage's parameters a rank's optimizer steps: its shard of `shards`,
    twice with a buddy copy (its owner's shard too)."""
    return (2.0 if buddy and shards > 1 else 1.0) / shards


def grad_buckets(params: float, replicas: int, overlap_grad_reduce: bool) -> int:
    """The buckets megatron-core's DDP reduces `params` gradients in over `replicas` ranks:
    with --overlap-grad-reduce its default bucket size, max(40M, 1M x replicas) parameters,
    else one bucket."""
    if not overlap_grad_reduce:
        return 1
    return max(1, math.ceil(params / max(40e6, 1e6 * replicas)))


def buddy_message_ms(profile: Profile, params: float, shards: int, late: float = 0.0) -> float:
    """What a reduction of `params` gradients sharded `shards` ways waits for a buddy's
    gradient message: the fp32 shard of the last bucket (grad_buckets), the others having
    crossed the links while later buckets were reduced, or of the `late` parameters summed
    again after the reduction (a tied embedding's), whichever is larger."""
    last = max(params / grad_buckets(params, shards, profile.overlap_grad_reduce), late)
    return profile.p2p_alpha_ms + profile.p2p_ms_per_mib * 4 * last / shards / MIB


def optimizer_params(plan: ExecutionPlan, rank: int, profile: Profile) -> float:
    """The parameters `rank`'s optimizer steps each iteration under `profile`'s sharding."""
    shards = optimizer_shards(plan, profile.optimizer_instances)[rank]
    return stage_params(plan, rank, profile.shape) * step_share(shards, profile.buddy_copies)


def predict_homogeneous(plan: ExecutionPlan, profile: Profile) -> Prediction:
    """predict() of a plan of identical pipelines under 1F1B (predict_plan: from one of them)."""
    return predict_plan(plan, profile)


def layout_key(plan: ExecutionPlan) -> str:
    """`plan`'s layout as one string, its generation left out: a layout's schedule and its
    prediction depend on nothing else, and both are cached under it."""
    layout = plan.to_dict()
    layout["generation"] = 0
    return json.dumps(layout, sort_keys=True)


def planned_schedule(plan: ExecutionPlan) -> Schedule:
    """The schedule the executor runs for `plan`, unfused (its fusion leaves the time
    unchanged) and unchecked: both generators are correct by construction, and the schedule
    that runs is checked when the executor builds it. Shared, not to be modified: a failure's
    candidates, a recalibration and a trace's simulation predict the same layouts again and
    again."""
    return _schedule_of(layout_key(plan))


@functools.lru_cache(maxsize=512)   # a few MiB at most: large layouts come a few at a time
def _schedule_of(layout: str) -> Schedule:
    return choose_schedule(ExecutionPlan.from_json(layout), fuse=False, checked=False)


# Plans of more than this many ranks (plan search at scale) are predicted uncached: their keys
# are large and the same layout rarely comes twice.
CACHED_RANKS = 1024


def predict_plan(plan: ExecutionPlan, profile: Profile,
                 start: dict[int, float] | None = None) -> Prediction:
    """_predict_plan of the plan with its ranks named 0..n-1 in their order (a naming that
    keeps every comparison of ranks, so every tie of the schedule), its result named back:
    the same layout on other GPUs is predicted once. With `cores` the host a rank shares
    depends on its name, so such plans are predicted as they are, uncached."""
    if profile.cores > 0 or plan.world_size > CACHED_RANKS:
        return _predict_plan(plan, profile, start)
    names = sorted(plan.ranks)
    canon = {r: i for i, r in enumerate(names)}
    slow = {canon[r]: f for r, f in profile.rank_slowdown.items() if r in canon}
    # a recovery's plans are named 0..n-1 already (ExecutionPlan.renumbered)
    same = names[-1] == len(names) - 1
    hit = _predicted(layout_key(plan if same else plan.relabelled(canon)), profile.cost_key,
                     json.dumps(sorted(slow.items())) if slow else "",
                     None if start is None else json.dumps(
                         {canon[r]: t for r, t in start.items() if r in canon}, sort_keys=True))
    return Prediction(hit.iteration_ms, {names[i]: m for i, m in hit.memory_bytes.items()},
                      hit.bubble_fraction, {names[i]: f for i, f in hit.sharing.items()})


# A failure's candidates, every later event of a trace and a recalibration predict the same
# layouts on other GPUs again and again; 4096 predictions are a few MiB for 32-GPU plans.
@functools.lru_cache(maxsize=4096)
def _predicted(layout: str, costs: str, slow: str, start: str | None) -> Prediction:
    """_predict_plan of a layout, a profile's costs (Profile.cost_key), its slow ranks as
    [rank, factor] pairs ("" for none) and each rank's start, all as JSON (the key)."""
    profile = Profile.from_dict({**json.loads(costs),
                                 "rank_slowdown": dict(json.loads(slow)) if slow else {}})
    return _predict_plan(ExecutionPlan.from_json(layout), profile,
                         None if start is None else
                         {int(r): t for r, t in json.loads(start).items()})


def _predict_plan(plan: ExecutionPlan, profile: Profile,
                  start: dict[int, float] | None = None) -> Prediction:
    """predict(plan, planned_schedule(plan), profile, start=start), from the fewest pipelines
    that determine it (`start` the same for every rank of a kind, as eager redundancy's
    refresh is: it depends on the rank's stage alone). Pipelines meet only in the gradient reduction, a collective that waits for all of its
    members; a pipeline that neither reroutes nor hosts rerouted work is scheduled and runs
    exactly like every other such pipeline with the same stages, micro-batch count and rank
    speeds. Likewise the tensor-parallel shards of a stage, each of which only talks to the
    same shard of its neighbours and replicas, run alike (a group runs at its slowest rank's
    pace). So the rerouted pipelines and their hosts are simulated beside one pipeline of each
    other kind, one shard of each stage, every reduction costed for its whole group,
    and the ranks left out take their representative's memory and busy time. Exact: the same
    op lists and the same float operations as the whole plan's run (the bubble fraction, a
    ratio of sums, to rounding). In a plan whose pipelines split the layers differently the
    gradient all-reduces chain stages of several pipelines; a twin links to what its
    representative links to, so each chain of the part is costed and waited for as its whole
    chain. Ranks sharing cores slow each other across pipelines, so with `cores` the whole plan
    is simulated."""
    if profile.cores > 0:
        return predict(plan, planned_schedule(plan), profile, validate=False, start=start)
    part, twin = _representatives(plan, profile)
    if not twin:
        return predict(plan, planned_schedule(plan), profile, validate=False, start=start)
    costs = ProfileCosts(part, profile, part_of=plan)
    res = simulate(part, planned_schedule(part), costs, timeline=False, validate=False,
                   start=start)
    memory = _memory(part, res, profile, plan.tensor_parallel, whole=plan)
    memory.update((r, memory[q]) for r, q in twin.items())
    # The bubble fraction is 1 - forward/backward busy time / (ranks x the end of the last
    # forward or backward); that end is the part's, the busy time adds the twins'.
    step = Op(OpKind.OPT_STEP)
    fb = {r: b - costs.compute(r, step) for r, b in res.busy.items()}
    part_fb = sum(fb.values())
    bubble = res.bubble_fraction
    if part_fb > 0:
        whole_fb = part_fb + sum(fb[q] for q in twin.values())
        bubble = 1.0 - (1.0 - bubble) * len(fb) * whole_fb / (part_fb * len(memory))
    return Prediction(with_overhead(res.iteration_time, profile.iteration_overhead_ms), memory,
                      bubble)


def _representatives(plan: ExecutionPlan, profile: Profile) -> \
        tuple[ExecutionPlan, dict[int, int]]:
    """The part of `plan` that predict_plan simulates: the pipelines that reroute or host
    rerouted work, and the first pipeline of each kind of the others (stage layers,
    micro-batch count, the groups' slowdowns), with only the first tensor-parallel shard of
    each stage; micro-batches renumbered in their order, which keeps every tie of the list
    scheduler. And each left-out rank -> its representative's rank."""
    pipelines = plan.pipelines
    owner = {r: pi for pi, p in enumerate(pipelines) for st in p.stages for r in st.ranks}
    touched: set[int] = set()
    for pi, p in enumerate(pipelines):
        for st in p.stages:
            if not st.ranks:
                touched.add(pi)
                touched.update(owner[ranks[0]] for ranks in st.hosts.values())
    slow = lockstep_slowdown(plan, profile.rank_slowdown)
    kinds: dict[tuple, int] = {}
    keep: list[int] = []
    twin: dict[int, int] = {}
    for pi, p in enumerate(pipelines):
        rep = pi
        if pi not in touched:
            kind = (len(p.micro_batches), tuple(
                (st.layer_start, st.layer_end, slow.get(st.ranks[0], 1.0)) for st in p.stages))
            rep = kinds.setdefault(kind, pi)
        if rep == pi:
            keep.append(pi)
        for st, like in zip(p.stages, pipelines[rep].stages):
            twin.update((r, like.ranks[0]) for r in st.ranks if r != like.ranks[0])
    if not twin:
        return plan, twin
    kept = sorted(mb for pi in keep for mb in pipelines[pi].micro_batches)
    new_id = {mb: i for i, mb in enumerate(kept)}
    part = ExecutionPlan(plan.num_layers, 1, plan.micro_batch_size, len(kept), [
        Pipeline([Stage(st.layer_start, st.layer_end, st.ranks[:1],
                        {new_id[mb]: h[:1] for mb, h in st.hosts.items()})
                  for st in pipelines[pi].stages],
                 [new_id[mb] for mb in pipelines[pi].micro_batches])
        for pi in keep], plan.generation)
    return part, twin


def transition_ms(profile: Profile, *, moved_bytes: int = 0, loaded_bytes: int = 0,
                  lost_iterations: int = 0, iteration_ms: float = 0.0) -> float:
    """Cost of going to a new plan: detection, the rebuild, state moved between ranks over the
    point-to-point link (`moved_bytes`: what the rank receiving the most receives), a
    checkpoint read (`loaded_bytes`: the largest rank's), and the iterations whose work is
    lost."""
    return (profile.detect_ms + profile.rebuild_ms
            + profile.p2p_ms_per_mib * moved_bytes / MIB
            + profile.load_ms_per_mib * loaded_bytes / MIB
            + lost_iterations * iteration_ms)


def switch_ms(profile: Profile, *, loaded_bytes: int = 0) -> float:
    """Cost of a planned move to a new plan from a checkpoint just written (a hybrid's second
    step): the rebuild and the checkpoint read; no failure to detect, no work lost."""
    return profile.rebuild_ms + profile.load_ms_per_mib * loaded_bytes / MIB


# ---- analytical profiles -----------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """Peak dense FLOP/s at the training precision, the fraction of it a layer reaches, and the
    bandwidths of the links used by pipeline messages, by gradient all-reduces and inside a
    tensor-parallel group (one node)."""

    name: str
    peak_tflops: float
    efficiency: float
    p2p_gbps: float                    # GB/s between pipeline stages (across nodes)
    allreduce_gbps: float              # GB/s per link of a data-parallel ring
    link_latency_us: float
    memory_gib: float
    tp_gbps: float                     # GB/s per link of a tensor-parallel ring (NVLink)
    tp_latency_us: float


DEVICES = {
    # bf16 dense peaks from the vendors' data sheets; 400 Gb/s InfiniBand per GPU across nodes.
    # Inside a node, NVLink: nccl-tests' ring all-reduce reaches a bus bandwidth of some
    # 450 GB/s on 8 H100 (NVLink 4) and 230 GB/s on 8 A100 (NVLink 3) at GB sizes; 80% of that
    # for the tens of MiB of a layer's activations.
    "H200": Device("H200", 989.0, 0.45, 50.0, 50.0, 10.0, 141.0, 360.0, 3.0),
    "H100": Device("H100", 989.0, 0.45, 50.0, 50.0, 10.0, 80.0, 360.0, 3.0),
    "A100": Device("A100", 312.0, 0.50, 25.0, 25.0, 10.0, 80.0, 185.0, 3.0),
}


def analytical_profile(shape: ModelShape, device: str = "A100") -> Profile:
    """Costs from FLOPs and bandwidths alone (no measurement): for paper-scale planning."""
    try:
        dev = DEVICES[device]
    except KeyError:
        raise ProfileError(f"unknown device {device!r} (known: {', '.join(DEVICES)})") from None
    flops_per_ms = dev.peak_tflops * 1e12 * dev.efficiency / 1e3
    layer = shape.layer_flops() / flops_per_ms
    recompute = shape.layer_recompute_flops() / flops_per_ms
    head = shape.head_flops() / flops_per_ms
    link_ms_per_mib = MIB / (dev.p2p_gbps * 1e9) * 1e3
    ring_ms_per_mib = MIB / (dev.allreduce_gbps * 1e9) * 1e3
    return Profile(
        source="analytical", device=dev.name, shape=shape,
        # a recomputed forward runs before the input gradients that need its activations
        layer_fwd_ms=layer, layer_bwd_input_ms=layer + recompute, layer_bwd_weight_ms=layer,
        embedding_fwd_ms=0.0, embedding_bwd_ms=0.0, head_fwd_ms=head, head_bwd_ms=2 * head,
        # Adam reads and writes ~16 bytes per parameter at ~2 TB/s of HBM.
        optimizer_ms_per_mparam=16e6 / 2e12 * 1e3,
        p2p_alpha_ms=dev.link_latency_us / 1e3, p2p_ms_per_mib=link_ms_per_mib,
        allreduce_alpha_ms=dev.link_latency_us / 1e3, allreduce_ms_per_mib=ring_ms_per_mib,
        tp_alpha_ms=dev.tp_latency_us / 1e3, tp_ms_per_mib=MIB / (dev.tp_gbps * 1e9) * 1e3,
        bytes_per_param=18 if shape.bytes_per_element == 2 else 16,
        device_memory_bytes=int(dev.memory_gib * 2 ** 30),
        notes=[f"analytical: {dev.peak_tflops:g} TFLOP/s x {dev.efficiency:g}, "
               f"{dev.p2p_gbps:g} GB/s links, {dev.tp_gbps:g} GB/s in a tensor-parallel "
               "group"])


def fit_layer_costs(stages: list[tuple[int, bool, bool, float]], shape: ModelShape,
                    with_backward: bool = False) -> tuple[float, float]:
    """(per-layer cost, head cost) from measured per-micro-batch stage costs [(layers, first,
    last, ms)]: the head is taken as head_flops / layer_flops layers (the embedding lookup as
    free), and the per-layer cost is the least-squares fit of ms = L * (layers + last * ratio).
    `with_backward`: the costs are forward and backward, each backward twice its forward and a
    layer's also its recomputed forward."""
    recompute = shape.layer_recompute_flops() if with_backward else 0.0
    ratio = shape.head_flops() / (shape.layer_flops() + recompute / 3)
    xs = [n + last * ratio for n, _, last, _ in stages]
    if not xs or sum(x * x for x in xs) == 0:
        return 0.0, 0.0
    per_layer = sum(x * ms for x, (_, _, _, ms) in zip(xs, stages)) / sum(x * x for x in xs)
    return per_layer, per_layer * ratio


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.inf
