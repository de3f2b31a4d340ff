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
the same op lists the executor runs. Ranks that share compute (several CPU processes on fewer
cores) are modelled as sharing a device: a host's `cores` are divided among the ranks placed on
it, so per-op times grow by ranks / cores when there are more ranks than cores.

This module imports only the standard library and chameleon_ext: never torch or megatron.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chameleon_ext.plan import ExecutionPlan, Pipeline
from chameleon_ext.schedule_ir import Op, OpKind, Schedule, one_f_one_b
from chameleon_ext.simulator import simulate

SOURCES = ("measured", "offline", "analytical")
MIB = 2 ** 20


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says why."""


@dataclass
class ModelShape:
    """The GPT configuration a profile describes (megatron-core GPTModel, learned positions)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    vocab_size: int
    ffn_hidden_size: int = 0          # 0: 4 x hidden_size
    bytes_per_element: int = 4        # activations and messages (fp32 on CPU, 2 for bf16)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def layer_params(self) -> int:
        """Attention (QKV + projection), MLP (two linears) and two layer norms, with biases."""
        h, f = self.hidden_size, self.ffn
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def embedding_params(self) -> int:
        """Word and position embeddings (the output layer shares the word embedding)."""
        return (self.vocab_size + self.seq_length) * self.hidden_size

    def message_bytes(self) -> int:
        """One activation or its gradient between stages: [seq, micro batch, hidden]."""
        return self.seq_length * self.micro_batch_size * self.hidden_size * self.bytes_per_element

    def layer_activation_bytes(self) -> int:
        """What one layer keeps for the backward of one micro-batch (Korthikanti et al. 2022:
        s*b*h*(34 + 5*a*s/h) bytes at 2-byte precision, scaled to bytes_per_element)."""
        s, b, h, a = self.seq_length, self.micro_batch_size, self.hidden_size, \
            self.num_attention_heads
        return int(s * b * h * (34 + 5 * a * s / h) * self.bytes_per_element / 2)

    def layer_flops(self) -> float:
        """Forward FLOPs of one layer for one micro-batch (matmuls and attention scores)."""
        s, b, h = self.seq_length, self.micro_batch_size, self.hidden_size
        return 2.0 * s * b * (4 * h * h + 2 * h * self.ffn) + 4.0 * b * s * s * h

    def head_flops(self) -> float:
        """Forward FLOPs of the output layer (logits over the vocabulary)."""
        return 2.0 * self.seq_length * self.micro_batch_size * self.hidden_size * self.vocab_size


@dataclass
class Profile:
    """Costs in milliseconds (per micro-batch for compute), bytes for memory. See the module
    docstring; `cores` > 0 means ranks on one host share that many cores (CPU)."""

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
    device_memory_bytes: int = 0       # per rank; 0: not limited
    cores: float = 0.0
    ranks_per_host: int = 0            # 0: all ranks on one host (with cores > 0)
    detect_ms: float = 50.0            # transition costs: failure to notice
    rebuild_ms: float = 400.0          # notice to a new runtime (groups, model, optimizer)
    load_ms_per_mib: float = 1.0       # reading a checkpoint
    iteration_overhead_ms: float = 0.0  # measured iteration time the simulated ops do not cover
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ProfileError(f"profile source {self.source!r} is not one of {', '.join(SOURCES)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        try:
            d = dict(d)
            d["shape"] = ModelShape(**d["shape"])
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

    def sharing(self, ranks_on_host: int) -> float:
        """How much slower each rank computes when `ranks_on_host` ranks share the host."""
        if self.cores <= 0:
            return 1.0
        return max(1.0, ranks_on_host / self.cores)

    def host_load(self, plan: ExecutionPlan) -> dict[int, float]:
        """rank -> its sharing factor under `plan` (ranks fill hosts in rank order)."""
        ranks = plan.ranks
        per = self.ranks_per_host or len(ranks)
        hosts: dict[int, int] = {}
        for i, _ in enumerate(ranks):
            hosts[i // per] = hosts.get(i // per, 0) + 1
        return {r: self.sharing(hosts[i // per]) for i, r in enumerate(ranks)}


class ProfileCosts:
    """The simulator's CostModel from a Profile, for one plan. `replicas` and `hosts_of` serve
    predict_homogeneous: one pipeline simulated for a plan of `replicas` identical ones,
    its ranks sharing hosts as in the plan `hosts_of`."""

    def __init__(self, plan: ExecutionPlan, profile: Profile, *, replicas: int = 0,
                 hosts_of: ExecutionPlan | None = None) -> None:
        self.profile = profile
        self._load = profile.host_load(hosts_of or plan)
        self._replicas = replicas
        self._stage: dict[int, tuple[int, bool, bool]] = {
            r: (plan.stage_of(r).num_layers, plan.is_first_stage(r), plan.is_last_stage(r))
            for r in plan.ranks}
        self._params = {r: stage_params(plan, r, profile.shape) for r in plan.ranks}
        self._msg_ms = profile.p2p_alpha_ms + profile.p2p_ms_per_mib * \
            profile.shape.message_bytes() / MIB

    def compute(self, rank: int, op: Op) -> float:
        p = self.profile
        n, first, last = self._stage[rank]
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
            ms = p.optimizer_ms_per_mparam * self._params[rank] / 1e6
        else:
            raise ValueError(f"rank {rank}, {op}: compute() is only defined for fwd, bwd, "
                             "bwd_input, bwd_weight and optimizer_step")
        return ms * self._load[rank]

    def p2p(self, src: int, dst: int, op: Op) -> float:
        return self._msg_ms

    def reduce(self, ranks: tuple[int, ...]) -> float:
        return allreduce_ms(self.profile, self._replicas or len(ranks),
                            self._params[ranks[0]] * 4)  # fp32 main grads


def allreduce_ms(profile: Profile, group: int, nbytes: int) -> float:
    """Ring all-reduce: 2 (n - 1) steps, each moving nbytes / n over one link."""
    if group <= 1:
        return 0.0
    steps = 2 * (group - 1)
    return steps * (profile.allreduce_alpha_ms + profile.allreduce_ms_per_mib * nbytes /
                    group / MIB)


def stage_params(plan: ExecutionPlan, rank: int, shape: ModelShape) -> int:
    """Parameters on `rank` (megatron-core's count): its layers' share (tensor parallel splits
    them), the embeddings on the first stage, and on the last the final layer norm and, when it
    is not also the first, its copy of the tied output weights."""
    n = plan.stage_of(rank).num_layers
    first, last = plan.is_first_stage(rank), plan.is_last_stage(rank)
    h = shape.hidden_size
    total = n * shape.layer_params() + first * shape.embedding_params() \
        + last * (2 * h + (not first) * shape.vocab_size * h)
    return total // plan.tensor_parallel


@dataclass
class Prediction:
    iteration_ms: float
    memory_bytes: dict[int, int]       # per rank: parameters, gradients, optimizer, activations
    bubble_fraction: float

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.memory_bytes.values(), default=0)


def predict(plan: ExecutionPlan, schedule: Schedule, profile: Profile,
            costs: ProfileCosts | None = None, validate: bool = True) -> Prediction:
    """Iteration time and per-rank memory of running `schedule` on `plan` (validate=False:
    a schedule correct by construction, not checked again)."""
    res = simulate(plan, schedule, costs or ProfileCosts(plan, profile), timeline=False,
                   validate=validate)
    shape = profile.shape
    memory = {}
    for r in plan.ranks:
        layers = plan.stage_of(r).num_layers
        acts = res.peak_inflight[r] * layers * shape.layer_activation_bytes() // \
            plan.tensor_parallel
        memory[r] = stage_params(plan, r, shape) * profile.bytes_per_param + acts
    return Prediction(res.iteration_time + profile.iteration_overhead_ms, memory,
                      res.bubble_fraction)


def predict_homogeneous(plan: ExecutionPlan, profile: Profile) -> Prediction:
    """predict() of a plan of identical pipelines under 1F1B, from one of them: the pipelines
    only meet in the gradient reduction, which is costed for all of them. Exact, and
    independent of the number of pipelines."""
    first = plan.pipelines[0]
    m = len(first.micro_batches)
    one = ExecutionPlan(plan.num_layers, plan.tensor_parallel, plan.micro_batch_size, m,
                        [Pipeline(first.stages, list(range(m)))])
    costs = ProfileCosts(one, profile, replicas=len(plan.pipelines), hosts_of=plan)
    return predict(one, one_f_one_b(one), profile, costs, validate=False)


def transition_ms(profile: Profile, *, moved_bytes: int = 0, loaded_bytes: int = 0,
                  lost_iterations: int = 0, iteration_ms: float = 0.0) -> float:
    """Cost of going to a new plan: detection, the rebuild, state moved between ranks over the
    point-to-point link, a checkpoint read, and the iterations whose work is lost."""
    return (profile.detect_ms + profile.rebuild_ms
            + profile.p2p_ms_per_mib * moved_bytes / MIB
            + profile.load_ms_per_mib * loaded_bytes / MIB
            + lost_iterations * iteration_ms)


# ---- analytical profiles -----------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """Peak dense FLOP/s at the training precision, the fraction of it a layer reaches, and the
    bandwidths of the links used by pipeline messages and by gradient all-reduces."""

    name: str
    peak_tflops: float
    efficiency: float
    p2p_gbps: float                    # GB/s between pipeline stages (across nodes)
    allreduce_gbps: float              # GB/s per link of a data-parallel ring
    link_latency_us: float
    memory_gib: float


DEVICES = {
    # bf16 dense peaks from the vendors' data sheets; 400 Gb/s InfiniBand per GPU across nodes.
    "H200": Device("H200", 989.0, 0.45, 50.0, 50.0, 10.0, 141.0),
    "H100": Device("H100", 989.0, 0.45, 50.0, 50.0, 10.0, 80.0),
    "A100": Device("A100", 312.0, 0.50, 25.0, 25.0, 10.0, 80.0),
}


def analytical_profile(shape: ModelShape, device: str = "A100") -> Profile:
    """Costs from FLOPs and bandwidths alone (no measurement): for paper-scale planning."""
    try:
        dev = DEVICES[device]
    except KeyError:
        raise ProfileError(f"unknown device {device!r} (known: {', '.join(DEVICES)})") from None
    flops_per_ms = dev.peak_tflops * 1e12 * dev.efficiency / 1e3
    layer = shape.layer_flops() / flops_per_ms
    head = shape.head_flops() / flops_per_ms
    link_ms_per_mib = MIB / (dev.p2p_gbps * 1e9) * 1e3
    ring_ms_per_mib = MIB / (dev.allreduce_gbps * 1e9) * 1e3
    return Profile(
        source="analytical", device=dev.name, shape=shape,
        layer_fwd_ms=layer, layer_bwd_input_ms=layer, layer_bwd_weight_ms=layer,
        embedding_fwd_ms=0.0, embedding_bwd_ms=0.0, head_fwd_ms=head, head_bwd_ms=2 * head,
        # Adam reads and writes ~16 bytes per parameter at ~2 TB/s of HBM.
        optimizer_ms_per_mparam=16e6 / 2e12 * 1e3,
        p2p_alpha_ms=dev.link_latency_us / 1e3, p2p_ms_per_mib=link_ms_per_mib,
        allreduce_alpha_ms=dev.link_latency_us / 1e3, allreduce_ms_per_mib=ring_ms_per_mib,
        bytes_per_param=18 if shape.bytes_per_element == 2 else 16,
        device_memory_bytes=int(dev.memory_gib * 2 ** 30),
        notes=[f"analytical: {dev.peak_tflops:g} TFLOP/s x {dev.efficiency:g}, "
               f"{dev.p2p_gbps:g} GB/s links"])


def fit_layer_costs(stages: list[tuple[int, bool, bool, float]], shape: ModelShape) -> \
        tuple[float, float]:
    """(per-layer cost, head cost) from measured per-micro-batch stage costs [(layers, first,
    last, ms)]: the head is taken as head_flops / layer_flops layers (the embedding lookup as
    free), and the per-layer cost is the least-squares fit of ms = L * (layers + last * ratio)."""
    ratio = shape.head_flops() / shape.layer_flops()
    xs = [n + last * ratio for n, _, last, _ in stages]
    if not xs or sum(x * x for x in xs) == 0:
        return 0.0, 0.0
    per_layer = sum(x * ms for x, (_, _, _, ms) in zip(xs, stages)) / sum(x * x for x in xs)
    return per_layer, per_layer * ratio


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.inf
