"""Schedule IR: one ordered op list per rank for one training iteration, and its generators.

The executor (megatron.elastic.schedules) runs these ops and the simulator times them: both read
the same lists, so what the performance model predicts is what runs.

Communication semantics, shared by executor and simulator: a send never blocks the sender (it is
posted and completes in the background); a receive blocks until the matching send from `peer` for
the same micro-batch and direction has been posted. Each (micro-batch, direction) pair is its own
message tag, so several messages between two ranks in one step can never be confused.

A schedule may fuse sends: a FusedMessage names several sends of one rank to one peer that travel
as one packed message (chameleon_ext.comm.packed). It is posted when its last member (in the sender's
order) is reached, carries every member, and is tagged with its first member's tag; the receiver
takes it at the first member's receive, and the later members' receives take their tensor from it.
Rerouting sends many small tensors to few peers; fusing them saves per-message latency
(chameleon_ext.schedule.message_fusion decides which, by simulation).

A backward is either one BWD op or split in two: BWD_INPUT (the gradient of the stage's input,
which the previous stage waits for) and, later on the same rank, BWD_WEIGHT (the gradients of the
linear layers' weights, which nobody waits for until the gradient reduction). Deferring the weight
halves into bubbles is how rerouted work is absorbed with the least idle time (ReCycle, and
zero-bubble pipeline parallelism before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from chameleon_ext.plan.execution_plan import ExecutionPlan


class OpKind(str, Enum):
    RECV_FWD = "recv_fwd"          # receive the input activation of `microbatch` from `peer`
    FWD = "fwd"                    # forward of `microbatch` through this rank's layers
    SEND_FWD = "send_fwd"          # send the output activation of `microbatch` to `peer`
    RECV_BWD = "recv_bwd"          # receive the gradient of this rank's output from `peer`
    BWD = "bwd"                    # backward of `microbatch` (input and weight gradients)
    BWD_INPUT = "bwd_input"        # the input-gradient half of a split backward of `microbatch`
    BWD_WEIGHT = "bwd_weight"      # its weight-gradient half, deferred (zero-bubble style)
    SEND_BWD = "send_bwd"          # send the gradient of this rank's input to `peer`
    REDUCE_GRADS = "reduce_grads"  # sum gradients over this rank's replicas (collective)
    OPT_STEP = "optimizer_step"    # clip, step, zero gradients


SENDS = (OpKind.SEND_FWD, OpKind.SEND_BWD)
COMPUTE = (OpKind.FWD, OpKind.BWD, OpKind.BWD_INPUT, OpKind.BWD_WEIGHT, OpKind.OPT_STEP)
RECVS = (OpKind.RECV_FWD, OpKind.RECV_BWD)
MATCHING_SEND = {OpKind.RECV_FWD: OpKind.SEND_FWD, OpKind.RECV_BWD: OpKind.SEND_BWD}
RECV_OF = {v: k for k, v in MATCHING_SEND.items()}


# Stages per pipeline the tags of an interleaved schedule leave room for.
MAX_STAGES = 1024


@dataclass(frozen=True)
class Op:
    kind: OpKind
    microbatch: int = -1
    peer: int = -1
    # In an interleaved plan, the stage (index in its pipeline) whose model chunk the op is
    # for; -1 where a rank holds one stage.
    stage: int = -1

    def __str__(self) -> str:
        s = self.kind.value
        if self.microbatch >= 0:
            s += f"(mb={self.microbatch}"
            s += f", stage={self.stage}" if self.stage >= 0 else ""
            s += f", peer={self.peer})" if self.peer >= 0 else ")"
        return s

    def message_tag(self) -> int:
        """The point-to-point tag: unique per (micro-batch, direction), and in an interleaved
        plan per stage boundary too (two ranks exchange one message per boundary between
        their chunks)."""
        forward = self.kind in (OpKind.SEND_FWD, OpKind.RECV_FWD)
        if self.stage < 0:
            return 2 * self.microbatch + (0 if forward else 1)
        # the boundary between stages b and b + 1 that the message crosses
        b = self.stage - (1 if self.kind in (OpKind.RECV_FWD, OpKind.SEND_BWD) else 0)
        return 2 * (self.microbatch * MAX_STAGES + b) + (0 if forward else 1)

    def to_dict(self) -> dict:
        d = {"kind": self.kind.value, "microbatch": self.microbatch, "peer": self.peer}
        if self.stage >= 0:
            d["stage"] = self.stage
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Op":
        return cls(OpKind(d["kind"]), int(d.get("microbatch", -1)), int(d.get("peer", -1)),
                   int(d.get("stage", -1)))


@dataclass(frozen=True)
class FusedMessage:
    """Sends of `src` to `dst` that travel as one packed message; `members` are the SEND_FWD /
    SEND_BWD ops (peer = dst) in the sender's order."""

    src: int
    dst: int
    members: tuple[Op, ...]

    def tag(self) -> int:
        return self.members[0].message_tag()

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "members": [m.to_dict() for m in self.members]}

    @classmethod
    def from_dict(cls, d: dict) -> "FusedMessage":
        return cls(int(d["src"]), int(d["dst"]), tuple(Op.from_dict(m) for m in d["members"]))


@dataclass
class Schedule:
    """Op lists of every rank of a plan for one iteration, and the sends fused among them."""

    ops: dict[int, list[Op]]
    fused: list[FusedMessage] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"ops": {str(r): [o.to_dict() for o in ops] for r, ops in sorted(self.ops.items())},
                "fused": [m.to_dict() for m in self.fused]}

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        return cls({int(r): [Op.from_dict(o) for o in ops] for r, ops in d["ops"].items()},
                   [FusedMessage.from_dict(m) for m in d.get("fused", [])])

    def fused_sends(self, rank: int) -> dict[Op, FusedMessage]:
        """This rank's fused send ops -> their message."""
        return {op: m for m in self.fused if m.src == rank for op in m.members}

    def fused_recvs(self, rank: int) -> dict[Op, FusedMessage]:
        """This rank's receive ops of fused messages -> their message."""
        return {Op(RECV_OF[op.kind], op.microbatch, m.src): m
                for m in self.fused if m.dst == rank for op in m.members}


def one_f_one_b(plan: ExecutionPlan) -> Schedule:
    """Megatron's non-interleaved 1F1B for every pipeline; with one stage it is plain F, B per
    micro-batch (forward_backward_no_pipelining). Rerouted plans need the list scheduler."""
    if plan.rerouted:
        raise ValueError("1F1B needs every stage to have its own ranks; this plan reroutes")
    return Schedule({rank: _rank_1f1b(plan, rank) for rank in plan.ranks})


def _rank_1f1b(plan: ExecutionPlan, rank: int) -> list[Op]:
    pos = plan.position(rank)
    pipe = plan.pipelines[pos.pipeline]
    num_stages = len(pipe.stages)
    prev, nxt = plan.prev_rank(rank), plan.next_rank(rank)
    mbs = pipe.micro_batches
    warmup = min(num_stages - pos.stage - 1, len(mbs))
    ops: list[Op] = []

    def forward(mb: int) -> None:
        if prev is not None:
            ops.append(Op(OpKind.RECV_FWD, mb, prev))
        ops.append(Op(OpKind.FWD, mb))
        if nxt is not None:
            ops.append(Op(OpKind.SEND_FWD, mb, nxt))

    def backward(mb: int) -> None:
        if nxt is not None:
            ops.append(Op(OpKind.RECV_BWD, mb, nxt))
        ops.append(Op(OpKind.BWD, mb))
        if prev is not None:
            ops.append(Op(OpKind.SEND_BWD, mb, prev))

    for mb in mbs[:warmup]:
        forward(mb)
    for i, mb in enumerate(mbs[warmup:]):
        forward(mb)
        backward(mbs[i])
    for mb in mbs[len(mbs) - warmup:]:
        backward(mb)
    ops.append(Op(OpKind.REDUCE_GRADS))
    ops.append(Op(OpKind.OPT_STEP))
    return ops


def interleaved_1f1b(plan: ExecutionPlan) -> Schedule:
    """Megatron-LM's interleaved 1F1B for a plan whose ranks hold V model chunks each (V x P
    stages per pipeline, stage k on the ranks of position k mod P): a rank's virtual
    micro-batch k is micro-batch (k // PV) P + k mod P of chunk (k mod PV) // P (backwards:
    the chunks in reverse); (P - p - 1) x 2 + (V - 1) x P forwards warm up, then one forward
    and one backward alternate. Each pipeline's micro-batch count must be a multiple of P."""
    out: dict[int, list[Op]] = {}
    for rank in plan.ranks:
        pipe = plan.pipeline_of(rank)
        chunks = plan.chunks(rank)
        v, depth = len(chunks), len(pipe.stages)
        p_size = depth // v
        if depth % v or any(s % p_size != chunks[0] for s in chunks):
            raise ValueError(f"rank {rank}'s stages {chunks} are not one position of an "
                             f"interleaved pipeline of {depth} stages")
        mbs = pipe.micro_batches
        if len(mbs) % p_size:
            raise ValueError(f"an interleaved pipeline of {p_size} ranks needs a multiple of "
                             f"{p_size} micro-batches per pipeline, not {len(mbs)}")
        p, total = chunks[0], len(mbs) * v
        warmup = min((p_size - p - 1) * 2 + (v - 1) * p_size, total)
        ops: list[Op] = []

        def virtual(k: int, forward: bool) -> tuple[int, int]:
            """(micro-batch, stage) of virtual micro-batch k."""
            c = (k % (p_size * v)) // p_size
            c = c if forward else v - 1 - c
            return mbs[(k // (p_size * v)) * p_size + k % p_size], chunks[c]

        def forward(k: int) -> None:
            mb, s = virtual(k, True)
            if s > 0:
                ops.append(Op(OpKind.RECV_FWD, mb, plan.prev_rank(rank, s), s))
            ops.append(Op(OpKind.FWD, mb, stage=s))
            if s + 1 < depth:
                ops.append(Op(OpKind.SEND_FWD, mb, plan.next_rank(rank, s), s))

        def backward(k: int) -> None:
            mb, s = virtual(k, False)
            if s + 1 < depth:
                ops.append(Op(OpKind.RECV_BWD, mb, plan.next_rank(rank, s), s))
            ops.append(Op(OpKind.BWD, mb, stage=s))
            if s > 0:
                ops.append(Op(OpKind.SEND_BWD, mb, plan.prev_rank(rank, s), s))

        for k in range(warmup):
            forward(k)
        for i in range(total - warmup):
            forward(warmup + i)
            backward(i)
        for k in range(total - warmup, total):
            backward(k)
        ops += [Op(OpKind.REDUCE_GRADS), Op(OpKind.OPT_STEP)]
        out[rank] = ops
    return Schedule(out)


def forward_only(plan: ExecutionPlan) -> Schedule:
    """Evaluation: every micro-batch forward along its path, no backward. Each rank takes its
    micro-batches in (position in the owning pipeline, id) order, the same key everywhere, so
    with non-blocking sends no rank waits on one that waits on it."""
    work: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in plan.ranks}
    for p in plan.pipelines:
        for order, mb in enumerate(p.micro_batches):
            for k, group in enumerate(plan.path(mb)):
                for t, rank in enumerate(group):
                    work[rank].append((order, mb, k, t))
    out: dict[int, list[Op]] = {}
    stage = (lambda k: k) if plan.interleaved else (lambda k: -1)
    for rank, items in work.items():
        ops: list[Op] = []
        for _, mb, k, t in sorted(items):
            path = plan.path(mb)
            if k > 0:
                ops.append(Op(OpKind.RECV_FWD, mb, path[k - 1][t], stage(k)))
            ops.append(Op(OpKind.FWD, mb, stage=stage(k)))
            if k + 1 < len(path):
                ops.append(Op(OpKind.SEND_FWD, mb, path[k + 1][t], stage(k)))
        out[rank] = ops
    return Schedule(out)
