"""The training loop's side of Chameleon's planning: the base profile of this job's model and
machine, the situation at a failure (checkpoint, horizon, failure rate), and the check of a
recovery's prediction against the iteration time measured after it."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from chameleon_ext.planning.perf_model import ModelShape, Profile, ProfileError
from chameleon_ext.planning import planner
from chameleon_ext.planning.planner import Situation
from megatron.training import checkpointing
from megatron.training.config import CheckpointConfig, ModelConfig

# Loopback gloo on one CPU host, estimated; what they miss stays in the calibrated overhead.
_CPU_LINKS = dict(p2p_alpha_ms=0.05, p2p_ms_per_mib=0.5, allreduce_alpha_ms=0.1,
                  allreduce_ms_per_mib=1.0)


def model_shape(model: ModelConfig, micro_batch_size: int) -> ModelShape:
    """The performance model's view of the model flags. Full recompute is costed as every
    layer recomputed on its own (--recompute-method uniform, --recompute-num-layers 1)."""
    return ModelShape(model.num_layers, model.hidden_size, model.num_attention_heads,
                      model.seq_length, micro_batch_size, model.padded_vocab_size,
                      model.ffn_hidden_size, 2 if (model.bf16 or model.fp16) else 4,
                      num_query_groups=model.num_query_groups or 0,
                      kv_channels=model.kv_channels or 0, gated_linear_unit=model.gated_linear_unit,
                      add_bias_linear=model.add_bias_linear,
                      tied_embeddings=model.tied_embeddings,
                      learned_positions=model.position_embedding_type == "learned_absolute",
                      max_position_embeddings=model.max_position_embeddings,
                      normalization=model.normalization, qk_layernorm=model.qk_layernorm,
                      num_experts=model.num_experts or 0,
                      moe_ffn_hidden_size=model.moe_ffn_hidden_size or 0,
                      moe_router_topk=model.moe_router_topk,
                      moe_shared_ffn=model.moe_shared_expert_intermediate_size or 0,
                      recompute=model.recompute_granularity or "")


def base_profile(shape: ModelShape, profile_file: str | None, cuda: bool) -> Profile:
    """`profile_file` (--chameleon-profile, checked to describe this model), else a profile of
    this machine with no compute costs yet (calibration fills them in): its cores shared by
    every rank on a CPU host, link costs estimated."""
    if profile_file:
        profile = Profile.load(profile_file)
        if profile.shape != shape:
            raise ProfileError(f"--chameleon-profile {profile_file} describes "
                               f"{profile.shape}, this job is {shape}")
        return profile
    cores = 0.0 if cuda else float(len(os.sched_getaffinity(0)))
    return Profile(source="measured", device="cuda" if cuda else "cpu", shape=shape,
                   layer_fwd_ms=0.0, layer_bwd_input_ms=0.0, layer_bwd_weight_ms=0.0,
                   embedding_fwd_ms=0.0, embedding_bwd_ms=0.0, head_fwd_ms=0.0,
                   head_bwd_ms=0.0, optimizer_ms_per_mparam=0.0, **_CPU_LINKS, cores=cores,
                   notes=["links: loopback estimate"])


@dataclass
class JobClock:
    """What the planner's Situation needs from the training loop."""

    checkpoint: CheckpointConfig
    train_iters: int
    mtbf_hours: float | None           # --chameleon-mtbf (None: this job's failure rate)
    eager_redundancy: bool
    # --chameleon-repair-minutes (None: the median of this job's rejoins, once there is one;
    # before, the launcher's restart delay, else the planner's horizon rule)
    repair_minutes: float | None = None
    restart_delay_s: float | None = None   # ElasticConfig.restart_delay_s
    started: float = field(default_factory=time.monotonic)
    failed_at: list[float] = field(default_factory=list)   # monotonic seconds of each loss
    # monotonic seconds of the loss of each rank no joiner has taken back yet, oldest first
    unrepaired: list[float] = field(default_factory=list)
    iteration_ms: list[float] = field(default_factory=list)
    repairs_s: list[float] = field(default_factory=list)   # failure -> rejoin, measured

    @property
    def failures(self) -> int:
        return len(self.failed_at)

    def rejoined(self, joiners: int = 1) -> None:
        """`joiners` ranks came back (admitted into the plan or standing by as spares): each
        takes back the oldest loss not yet taken back, its repair time measured."""
        now = time.monotonic()
        for _ in range(min(joiners, len(self.unrepaired))):
            self.repairs_s.append(now - self.unrepaired.pop(0))

    def repair_hours(self) -> float | None:
        if self.repair_minutes is not None:
            return self.repair_minutes / 60.0
        if self.repairs_s:  # failure to admission, measured: the delay and what it leaves out
            return statistics.median(self.repairs_s) / 3600.0
        return None if self.restart_delay_s is None else self.restart_delay_s / 3600.0

    def lost(self, seconds_ago: float = 0.0, ranks: int = 1) -> None:
        """A failure (`ranks` ranks lost at once) `seconds_ago` seconds ago. Every rank
        records each one after its transition, so whichever rank leads the next decision
        knows them all; a decision retried, or an admission's plan, records none."""
        at = time.monotonic() - seconds_ago
        self.failed_at.append(at)
        self.unrepaired += [at] * ranks

    def situation(self, iteration: int) -> Situation:
        """At a failure during `iteration`: the failures so far and this one."""
        return self._situation(iteration, [*self.failed_at, time.monotonic()])

    def outlook(self, iteration: int) -> Situation:
        """Before `iteration`, with the failures seen so far (at least one expected: the
        rate of a job that has seen none is its running time so far)."""
        return self._situation(iteration, self.failed_at)

    def _situation(self, iteration: int, failed_at: list[float]) -> Situation:
        root = self.checkpoint.save or self.checkpoint.load
        ckpt = (checkpointing.latest_iteration(root) or 0) if root else 0
        mtbf = self.mtbf_hours
        if mtbf is None:
            mtbf = (time.monotonic() - self.started) / 3600.0 / max(len(failed_at), 1)
        recent = self.iteration_ms[-10:]
        return Situation(iteration=iteration, checkpoint_iteration=ckpt,
                         remaining_iterations=self.train_iters - iteration + 1,
                         mtbf_hours=mtbf,
                         failure_free_ms=statistics.median(recent) if recent else 0.0,
                         # periodic saves only where there is somewhere to save
                         save_interval=(self.checkpoint.save_interval or 0)
                         if self.checkpoint.save else 0,
                         eager_redundancy=self.eager_redundancy,
                         repair_hours=self._next_repair_hours(),
                         failure_record=self._failure_record(failed_at))

    def _next_repair_hours(self) -> float | None:
        """Until a lost slot is back: this failure's, or an earlier one's still out
        (planner.next_repair)."""
        repair = self.repair_hours()
        if repair is None:
            return None
        return planner.next_repair(repair * 3600.0, self.unrepaired, time.monotonic()) / 3600.0

    def _failure_record(self, failed_at: list[float]) -> tuple[int, int]:
        """planner.Situation.failure_record of the losses at `failed_at`; none without a
        repair time."""
        repair = self.repair_hours()
        if repair is None:
            return 0, 0
        return planner.failure_record(failed_at, repair * 3600.0, time.monotonic())


@dataclass
class PredictionCheck:
    """The median of the iterations measured after a recovery (the first one, which warms up
    the new groups, left out) beside its predicted iteration time."""

    predicted_ms: float
    iteration: int                     # of the recovery
    strategy: str
    wanted: int = 8
    measured: list[float] = field(default_factory=list)
    _skipped: bool = False

    def add(self, ms: float) -> bool:
        """True once `wanted` iterations are measured."""
        if not self._skipped:
            self._skipped = True
            return False
        self.measured.append(ms)
        return len(self.measured) >= self.wanted

    def result(self) -> dict | None:
        if not self.measured:
            return None
        measured = statistics.median(self.measured)
        return {"recovery_iteration": self.iteration, "strategy": self.strategy,
                "predicted_iter_ms": round(self.predicted_ms, 3),
                "measured_iter_ms": round(measured, 3), "iterations": len(self.measured),
                "relative_error": round(abs(self.predicted_ms - measured) / measured, 4)}

    def line(self) -> str:
        r = self.result()
        return (f"> prediction of the recovery at iteration {r['recovery_iteration']} "
                f"({r['strategy']}): {r['predicted_iter_ms']:.1f} ms/iteration, measured "
                f"{r['measured_iter_ms']:.1f} ms over {r['iterations']} iteration(s) "
                f"({100 * r['relative_error']:.1f}% off)")
