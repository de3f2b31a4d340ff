"""Emulated accelerators: a rank behaves like a dedicated device of a performance profile.

Several ranks on a few CPU cores cannot show a strategy's trade-offs: losing a rank makes the
others faster. With `--chameleon-emulate PROFILE.json` each rank still computes the real small
model, and then waits (sleeps) until the profile's device would have finished:

- a compute op (forward, input and weight halves of the backward, the optimizer step, the
  embedding and output layer inside them) ends no earlier than its start plus the simulator's
  cost of that op for the profile (ProfileCosts.compute: a layer of this job costs what a
  layer of the profile's model shape costs), times the dilation;
- a received message, a gradient all-reduce and a state transfer take, after their real
  transfer, the profile's link time for the bytes of the profile's model shape;
- a checkpoint save or load takes the emulated checkpoint's bytes over the storage's
  bandwidth (STORAGE_MIB_PER_S unless --chameleon-emulate-storage says otherwise);
- eager redundancy's refresh of the shadow copies takes its messages' link time for the
  profile's model (strategies.redundancy.refresh_ms).

The waits are sleeps, never spins: while one rank sleeps the others compute on the cores it
left. With a dilation large enough that every op's real time fits in its emulated time, each
rank runs like a device of its own, only `dilation` times slower. An op whose real time exceeds
its emulated time is an overrun (the first iteration under each plan, a warm-up, is not
counted); above OVERRUN_LIMIT of them the run does not emulate the profile (it is reported
invalid: raise the dilation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import MIB, ModelShape, Profile, ProfileCosts, stage_params
from chameleon_ext.planning.strategies.redundancy import refresh_ms
from chameleon_ext.schedule.ir import Op, OpKind
from chameleon_ext.schedule.simulator import reduction_components

# Storage a checkpoint is written to and read from, per rank: 2 GiB/s, what one GPU node's
# share of a parallel file system or a local NVMe drive sustains for large sequential files.
STORAGE_MIB_PER_S = 2048.0
# Above this share of overrun ops the run's timing is the host's, not the profile's.
OVERRUN_LIMIT = 0.01

_MS_FIELDS = ("layer_fwd_ms", "layer_bwd_input_ms", "layer_bwd_weight_ms", "embedding_fwd_ms",
              "embedding_bwd_ms", "head_fwd_ms", "head_bwd_ms", "optimizer_ms_per_mparam",
              "p2p_alpha_ms", "p2p_ms_per_mib", "allreduce_alpha_ms", "allreduce_ms_per_mib",
              "tp_alpha_ms", "tp_ms_per_mib")


def emulated_profile(profile: Profile, dilation: float,
                     storage_mib_per_s: float = STORAGE_MIB_PER_S) -> Profile:
    """The device a rank emulates, as the planner should see it: every compute and link cost
    times `dilation`, checkpoint reads at `storage_mib_per_s` (dilated), one dedicated device per
    rank (no shared cores). Detection and rebuild stay the profile's: they are real here, and
    the live calibration measures them."""
    scaled = {name: getattr(profile, name) * dilation for name in _MS_FIELDS}
    tp_allreduce = profile.tp_allreduce_ms * dilation if profile.tp_allreduce_ms >= 0 else -1.0
    return replace(profile, **scaled, tp_allreduce_ms=tp_allreduce, cores=0.0,
                   ranks_per_host=0, load_ms_per_mib=1e3 / storage_mib_per_s * dilation,
                   iteration_overhead_ms=0.0,
                   notes=[*profile.notes, f"emulated, dilation {dilation:g}"])


@dataclass
class OverrunCount:
    """Padded ops of one rank over the whole job, and those whose real time was longer."""

    ops: int = 0
    overruns: int = 0
    worst_ms: float = 0.0    # the largest real time beyond an emulated one

    def add(self, late_s: float) -> None:
        self.ops += 1
        if late_s > 0:
            self.overruns += 1
            self.worst_ms = max(self.worst_ms, late_s * 1e3)


def emulation_event(counts: list[OverrunCount], dilation: float) -> dict:
    """The `emulation` metrics event of a job from every rank's count: valid while at most
    OVERRUN_LIMIT of the padded ops overran."""
    ops = sum(c.ops for c in counts)
    overruns = sum(c.overruns for c in counts)
    share = overruns / ops if ops else 0.0
    return {"dilation": dilation, "ops": ops, "overruns": overruns, "share": round(share, 6),
            "worst_overrun_ms": round(max((c.worst_ms for c in counts), default=0.0), 3),
            "valid": share <= OVERRUN_LIMIT}


@dataclass
class Emulation:
    """One rank's emulated device, for the whole job; `device(plan, rank)` binds it to a plan.
    `job_shape` is the model this job really trains: state it moves is scaled to the profile's
    shape by their parameter counts."""

    profile: Profile          # as given (undilated)
    dilation: float
    job_shape: ModelShape
    storage_mib_per_s: float = STORAGE_MIB_PER_S
    count: OverrunCount = field(default_factory=OverrunCount)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.perf_counter
    device_profile: Profile = field(init=False)   # what the planner plans with

    def __post_init__(self) -> None:
        self.device_profile = emulated_profile(self.profile, self.dilation,
                                               self.storage_mib_per_s)

    def device(self, plan: ExecutionPlan, rank: int) -> EmulatedDevice:
        return EmulatedDevice(self, ProfileCosts(plan, self.device_profile), plan, rank)

    def pad(self, began: float, emulated_ms: float, *, counted: bool) -> None:
        """Sleep until `emulated_ms` after `began` (perf_counter seconds); `counted`: the op's
        real time must fit in it (compute, not a wait on a peer or in a barrier)."""
        late = self.clock() - (began + emulated_ms / 1e3)
        if counted:
            self.count.add(late)
        if late < 0:
            self.sleep(-late)

    def transferred(self, received: dict[str, int]) -> None:
        """After a state transfer that brought `received` (bytes per parameter name, the
        layout-independent names of state_transfer) of this job's model: the link time of as
        much of the profile's model, each parameter scaled as what it is there. The two models
        do not scale alike: a layer of a 1.3B GPT is 1,000 of this job's, its word embeddings
        4,000 times this job's (scaling those as layers emulated 178M parameters' state for a
        joiner of a first stage of three layers, where the planner counts 258M)."""
        nbytes = sum(b * self._scale(name) for name, b in received.items())
        if nbytes <= 0:
            return
        p = self.device_profile
        self.pad(self.clock(), p.p2p_alpha_ms + p.p2p_ms_per_mib * nbytes / MIB,
                 counted=False)

    def _scale(self, name: str) -> float:
        """How many elements of the profile's model one element of this job's parameter `name`
        stands for."""
        p, j = self.device_profile.shape, self.job_shape
        if name.startswith("decoder.layers."):
            return p.layer_params() / j.layer_params()
        if name.startswith(("embedding.word_embeddings.", "output_layer.")):
            return p.vocab_size * p.hidden_size / (j.vocab_size * j.hidden_size)
        if name.startswith("embedding.position_embeddings."):
            # learned positions: the embeddings beyond the words' (none in a RoPE profile)
            def positions(s: ModelShape) -> int:
                return s.embedding_params() - s.vocab_size * s.hidden_size

            return positions(p) / max(positions(j), 1)
        return p.hidden_size / j.hidden_size     # the final norm

    def event(self, counts: list[OverrunCount]) -> dict:
        return emulation_event(counts, self.dilation)


@dataclass
class EmulatedDevice:
    """The executor's and the checkpoint's padding under one plan (StageRuntime.emulation)."""

    emulation: Emulation
    costs: ProfileCosts
    plan: ExecutionPlan
    rank: int

    def __post_init__(self) -> None:
        self._group = reduction_components(self.plan)[self.rank]
        self._refresh_ms = refresh_ms(self.plan, self.emulation.device_profile).get(self.rank,
                                                                                     0.0)
        # The first iteration under a plan pays one-time costs (allocations, first messages
        # on new groups) that every timing here leaves out as warm-up: its ops are padded but
        # not counted.
        self._warm = False

    def computed(self, op: Op, began: float) -> None:
        """After compute op `op` that began at `began`: until the device would have finished."""
        self.emulation.pad(began, self.costs.compute(self.rank, op), counted=self._warm)
        if op.kind is OpKind.OPT_STEP:
            self._warm = True

    def received(self, op: Op) -> None:
        """After the real arrival of the message of receive `op` (a fused message once): its
        latency on the profile's link, paid on the receiving side as in the simulator. The
        sender's post time is not known here, so a message that was already waiting pays the
        whole latency too (the simulator: only what is left of it), at most one link time
        more."""
        self.emulation.pad(self.emulation.clock(), self.costs.p2p(op.peer, self.rank, op),
                           counted=False)

    def reduced(self) -> None:
        """After the real gradient all-reduce: the profile's, for this rank's group."""
        self.emulation.pad(self.emulation.clock(), self.costs.reduce(self._group), counted=False)

    def refreshed(self, began: float) -> None:
        """After this rank's refresh of eager redundancy's shadow copies that began at
        `began`: its messages over the profile's link, for the profile's model (not counted:
        the refresh waits on its peers)."""
        self.emulation.pad(began, self._refresh_ms, counted=False)

    def checkpoint_io(self, began: float) -> None:
        """After this rank's part of a checkpoint save or load that began at `began`: its
        state in the profile's shape over the storage."""
        p = self.emulation.device_profile
        nbytes = stage_params(self.plan, self.rank, p.shape) * p.bytes_per_param
        # Not counted: the real save and load wait in barriers for the slowest rank.
        self.emulation.pad(began, p.load_ms_per_mib * nbytes / MIB, counted=False)
