"""What a job tells its user: Megatron's log lines, the recovery lines, the metrics file's
events (docs/ARCHITECTURE.md "Metrics file"), tensorboard scalars and the closing summary.

One Reporter per process; only the lead (rank 0 of the current world, which may change after a
failure) writes. The lines a collective gathers (memory, replicas, shadow copies) are gathered
by the caller on every rank and printed here."""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.schedule.ir import OpKind
from chameleon_ext.schedule.message_fusion import message_count
from megatron.elastic.emulation import OVERRUN_LIMIT
from megatron.training import planning
from megatron.training.config import LoggingConfig
from megatron.training.metrics import MetricsFile, Tensorboard, iteration_line


@dataclass
class Reporter:
    logging: LoggingConfig
    train_iters: int
    seq_length: int                              # tokens per sample, for the throughput
    lead: bool                                   # rank 0 of the current world
    # the model's training FLOPs per sample, for --log-throughput (0: not logged)
    flops_per_sample: float = 0.0
    metrics: MetricsFile = field(init=False)
    tb: Tensorboard = field(init=False)
    bar: object = field(init=False, default=None)
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    # (index into times where a transition happened, generation)
    events: list[tuple[int, int]] = field(default_factory=list)
    check: planning.PredictionCheck | None = None
    skipped: int = 0
    last_record: dict | None = None              # the last iteration's metrics fields

    def __post_init__(self) -> None:
        self.metrics = MetricsFile(self.logging.metrics_file)
        self.tb = Tensorboard(self.logging.tensorboard_dir if self.lead else None,
                              self.logging.tensorboard_queue_size)

    # ---- lines -------------------------------------------------------------------------------
    def line(self, text: str) -> None:
        if not self.lead:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(text, flush=True)

    def start(self, plan: ExecutionPlan, placement: str | None, schedule, start: int,
              setup: str, strategy: str | None, injected: int) -> None:
        """The job's first lines: `setup` says what runs it (backend, kernels); `strategy` is
        the recovery strategy, None without in-process recovery."""
        if self.lead:
            self.line(f"> plan: {plan.world_size} ranks, {len(plan.pipelines)} pipeline(s) x "
                      f"{len(plan.pipelines[0].stages)} stage(s), tensor parallel "
                      f"{plan.tensor_parallel}, {plan.num_micro_batches} micro-batches of "
                      f"{plan.micro_batch_size} per iteration, "
                      + (f"{len(plan.chunks(plan.ranks[0]))} model chunks per rank "
                         "(interleaved), " if plan.interleaved else "")
                      + "layers per stage "
                      + " | ".join(dict.fromkeys(   # each pipeline's split, once
                          ", ".join(str(st.num_layers) for st in p.stages)
                          for p in plan.pipelines))
                      + (f"; {placement}" if placement else ""))
            self.line(f"> {setup}")
            self.line(schedule_line(schedule))
            if strategy is not None:
                self.line(f"> chameleon: in-process recovery on (strategy "
                          f"{strategy}), {injected} injected fault(s)")
            if self.logging.progress_bar:
                from tqdm import tqdm
                self.bar = tqdm(total=self.train_iters, initial=start, desc="training", unit="it",
                                file=sys.stderr, dynamic_ncols=True)

    def took_over(self, applied: int) -> None:
        """This rank became the lead in a transition that lost the old one, which may have
        died between the step of `applied` (every rank knows its loss from the commit) and its
        record: the record is written again (a reader keeps the last line of an iteration)."""
        if self.last_record is not None and self.last_record["iteration"] == applied:
            self.metrics.write("iteration", **self.last_record)

    def iteration(self, it: int, res, ms: float, consumed: int, plan: ExecutionPlan,
                  strategy: str, lr: float, timers_text,
                  loss_scale: Callable[[], float] = lambda: 1.0,
                  params_norm: float | None = None) -> None:
        """`timers_text` and `loss_scale` are read only where they are logged."""
        self.skipped += 0 if res.update_successful else 1
        self.losses.append(res.loss)
        self.times.append(ms)
        if self.check and self.check.add(ms):
            self.prediction()
        tokens_per_s = plan.global_batch_size * self.seq_length / (ms / 1e3)
        tflops = (self.flops_per_sample * plan.global_batch_size / (ms / 1e3) / 1e12
                  / plan.world_size if self.flops_per_sample else None)
        self.last_record = dict(iteration=it, loss=res.loss, consumed_samples=consumed,
                                elapsed_ms=round(ms, 3), tokens_per_s=round(tokens_per_s, 1),
                                world=plan.world_size, generation=plan.generation,
                                strategy=strategy)
        if self.lead:
            self.metrics.write("iteration", **self.last_record)
        log = self.logging
        if it % log.tensorboard_log_interval == 0:
            self.tb.scalars(it, **{
                "lm loss": res.loss, "learning-rate": lr, "batch-size": plan.global_batch_size,
                "grad-norm": res.grad_norm, "iteration-time": ms / 1e3,
                "tokens-per-second": tokens_per_s, "throughput": tflops,
                "num-zeros": res.num_zeros, "params-norm": params_norm,
                "loss-scale": loss_scale() if log.log_loss_scale and self.tb.on else None,
                "world-size": plan.world_size if log.log_world_size else None,
                **(cuda_memory() if log.log_memory else {})})
        if it % self.logging.log_interval == 0:
            self.line(iteration_line(
                iteration=it, train_iters=self.train_iters, consumed=consumed, elapsed_ms=ms, lr=lr,
                gbs=plan.global_batch_size, loss=res.loss, grad_norm=res.grad_norm,
                tokens_per_s=tokens_per_s, skipped=self.skipped, tflops_per_gpu=tflops,
                num_zeros=res.num_zeros, params_norm=params_norm))
            text = timers_text()
            if text:
                self.line(text.rstrip())
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{res.loss:.4f}")

    def validation(self, it: int, loss: float) -> None:
        ppl = math.exp(min(loss, 20))
        self.line(f" validation loss at iteration {it} | lm loss value: {loss:.6E} |"
                  f" lm loss PPL: {ppl:.6E} |")
        self.tb.scalars(it, **{"lm loss validation": loss, "lm loss validation ppl":
                               ppl if self.logging.log_validation_ppl else None})
        if self.lead:
            self.metrics.write("validation", iteration=it, loss=loss)

    def saved(self, it: int, path) -> None:
        self.line(f"  successfully saved checkpoint at iteration {it} to {path}")

    def moved_to(self, iteration: int) -> None:
        """Training goes on after `iteration` (a restart may have gone back)."""
        if self.bar is not None:
            self.bar.n = iteration
            self.bar.refresh()

    # ---- transitions -------------------------------------------------------------------------
    def recovery(self, t, failure, resume: int, schedule) -> None:
        """A transition caused by a failure (manager.Transition, manager.Failure)."""
        d, plan = t.decision, t.plan
        reconfigure_ms = 1e3 * (time.time() - t.first_notice)
        cause = ", ".join(f"rank {r}: {c}" for r, c in t.causes.items())
        recent = self.times[-10:]
        before = statistics.median(recent) if recent else None
        it = failure.iteration
        lost = it - 1 - resume + (1 if failure.during == "step" else 0)
        self.events.append((len(self.times), plan.generation))
        if not self.lead:
            return
        self.metrics.write("failure", generation=t.old_generation, ranks=t.failed,
                           cause=",".join(sorted(set(t.causes.values()))),
                           detect_ms=None if t.detect_ms is None
                           else round(max(t.detect_ms, 0.0), 1), during=failure.during)
        self.metrics.write("recovery", generation=plan.generation, strategy=d.strategy,
                           candidates=d.candidates, profile=d.profile,
                           predicted_iter_ms=d.predicted_iter_ms,
                           switch=None if d.switch is None else {
                               k: v for k, v in d.switch.to_dict().items() if k != "plan"},
                           reconfigure_ms=round(reconfigure_ms, 1), lost_iterations=lost,
                           resume_iteration=resume + 1, world=plan.world_size,
                           moved_bytes=t.entered.moved_bytes, attempts=t.attempts,
                           spares=len(t.spares), why=d.why)
        detect = "" if t.detect_ms is None else \
            f", detected {max(t.detect_ms, 0.0):.0f} ms after it"
        where = "" if failure.during == "step" else f" (during the {failure.during})"
        lines = [
            f"> recovery at iteration {it}{where}: lost launch rank(s) {t.failed} "
            f"({cause}){detect}",
            f"  ({failure.error})",
            f"  strategy {d.strategy}: {_what(d, plan, resume, t.entered.moved_bytes)}",
            "  " + schedule_line(schedule)[2:],
            f"  new world {plan.world_size} ranks, generation {plan.generation}"
            + (f" after {t.attempts} attempts" if t.attempts > 1 else "")
            + (f", spare(s) {t.spares}" if t.spares else "")
            + f", reconfigured in {reconfigure_ms:.0f} ms; training goes on from iteration "
            f"{resume + 1} ({lost} iteration(s) lost)"
            + (f" (before: {before:.1f} ms/iteration)" if before else ""),
        ]
        for c in d.candidates:
            chosen = "  <- chosen" if c["strategy"] == d.strategy else ""
            lines.append(
                f"  candidate {c['strategy']:<16} {c['layout']:<28} predicted "
                f"{c['predicted_iter_ms']:8.1f} ms/iteration, transition "
                f"{c['transition_ms']:8.1f} ms, memory {c['memory_mib']:8.1f} MiB"
                + ("" if c["feasible"] else ", DOES NOT FIT") + chosen)
        if d.switch:
            lines.append(f"  then {d.switch.strategy} after the checkpoint of iteration "
                         f"{d.switch.at_iteration} (predicted "
                         f"{d.switch.predicted_iter_ms:.1f} ms/iteration)")
        for line in lines:
            self.line(line)
        self._expect(d, it)

    def switched(self, t, it: int) -> None:
        plan = t.plan
        self.events.append((len(self.times), plan.generation))
        self.line(f"> switched at iteration {it} to the {t.decision.strategy} plan: "
                  f"{layout_text(plan)} on {plan.world_size} ranks, generation "
                  f"{plan.generation}, from the checkpoint of iteration {it}")
        if self.lead:
            if self.check and self.check.result():
                self.prediction()
            self.metrics.write("switch", iteration=it, strategy=t.decision.strategy,
                               generation=plan.generation, world=plan.world_size)
            self._expect(t.decision, it)

    def spare_lost(self, it: int, launch_rank: int, left: int) -> None:
        """A spare (alive out of the world, holding no state) was lost: nothing to recover."""
        if not self.lead:
            return
        self.metrics.write("spare_lost", iteration=it, launch_rank=launch_rank, spares=left)
        self.line(f"> launch rank {launch_rank}, a spare, was lost after iteration {it}; "
                  f"{left} spare(s) left")

    def rejoined(self, t, it: int) -> None:
        d, plan = t.decision, t.plan
        self.events.append((len(self.times), plan.generation))
        if not self.lead:
            return
        if self.check and self.check.result():
            self.prediction()
        reconfigure_ms = 1e3 * (time.time() - t.first_notice)
        self.metrics.write("rejoin", iteration=it, joined=d.joined, strategy=d.strategy,
                           generation=plan.generation, world=plan.world_size,
                           moved_bytes=t.entered.moved_bytes,
                           reconfigure_ms=round(reconfigure_ms, 1),
                           predicted_iter_ms=d.predicted_iter_ms, plan=plan.to_dict(),
                           spares=len(t.spares))
        who = f"launch rank(s) {d.joined} admitted" if d.joined else \
            f"every joiner stands by as a spare ({len(t.spares)} in all)"
        self.line(f"> rejoin after iteration {it}: {who}; "
                  f"{d.strategy} plan {layout_text(plan)} on {plan.world_size} ranks, "
                  f"generation {plan.generation}; {t.entered.moved_bytes / 2**20:.2f} MiB of "
                  f"parameters and optimizer state moved to them; reconfigured in "
                  f"{reconfigure_ms:.0f} ms")
        self._expect(d, it)

    def _expect(self, decision, it: int) -> None:
        """Check the decision's predicted iteration time against the next measured ones."""
        predicted = decision.predicted_iter_ms
        self.check = planning.PredictionCheck(predicted, it, decision.strategy) \
            if predicted else None

    def prediction(self) -> None:
        if self.check is None or not self.check.result():
            return
        if self.lead:
            self.metrics.write("prediction", **self.check.result())
            self.line(self.check.line())
        self.check = None

    # ---- end of the job ----------------------------------------------------------------------
    def shadows(self, everyone: list[tuple[int, float]]) -> None:
        """Eager redundancy's measured cost: the largest holder's copies and the slowest
        refresh, from every rank's (held bytes, refresh ms per iteration)."""
        if not self.lead:
            return
        held, sync = max(b for b, _ in everyone), max(ms for _, ms in everyone)
        self.metrics.write("redundancy", held_bytes=held, sync_ms=round(sync, 3))
        self.line(f"> eager redundancy: shadow copies of {held / 2**20:.2f} MiB on the largest "
                  f"holder, refreshed in {sync:.2f} ms per iteration (slowest rank)")

    def memory(self, ranks: list[dict]) -> None:
        """Every rank's measured memory beside its estimate (None: measured only)."""
        if not self.lead:
            return
        self.metrics.write("memory", ranks=ranks)
        most = max(x["measured_bytes"] for x in ranks) / 2**20
        if ranks[0]["estimated_bytes"] is None:  # a job without --chameleon: no profile
            state = max(x["optimizer_bytes"] for x in ranks) / 2**20
            self.line(f"> memory per rank: measured {most:.2f} MiB at most, of it optimizer "
                      f"state {state:.2f} MiB at most")
            return
        worst = max(ranks, key=lambda x: x["measured_bytes"] / max(x["estimated_bytes"], 1))
        planned = max(x["estimated_bytes"] for x in ranks) / 2**20
        self.line(f"> memory per rank: measured {most:.2f} MiB at most, estimated "
                  f"{planned:.2f} MiB; measured/estimated at most "
                  f"{worst['measured_bytes'] / max(worst['estimated_bytes'], 1):.3f} (rank "
                  f"{worst['rank']})")

    def emulation(self, event: dict) -> None:
        """Emulated devices: how many padded ops overran their emulated time."""
        if not self.lead:
            return
        self.metrics.write("emulation", **event)
        self.line(f"> emulation (dilation {event['dilation']:g}): {event['overruns']} of "
                  f"{event['ops']} padded ops overran ({100 * event['share']:.2f}%)")
        if not event["valid"]:
            self.line(f"WARNING: this run is invalid as an emulation: "
                      f"{100 * event['share']:.1f}% of its ops overran their emulated time "
                      f"(over {100 * OVERRUN_LIMIT:g}%); raise --chameleon-emulate-dilation")

    def replicas(self, everyone: list[dict[str, str]]) -> None:
        """Every copy of every parameter and optimizer-state tensor must be bit-identical."""
        if not self.lead:
            return
        differ = differing(everyone)
        seen = {name for digests in everyone for name in digests}
        params = sum(1 for n in seen if "#" not in n)
        self.metrics.write("replicas", parameters=params, tensors=len(seen),
                           identical=not differ, differing=differ[:10])
        self.line(f"> replicas: {params} parameters and their optimizer state ({len(seen)} "
                  "tensors), " + ("all copies bit-identical" if not differ
                                  else f"{len(differ)} DIFFER: {differ[:3]}"))

    def weight_hash(self, it: int, tensors: int, differ: list[str]) -> None:
        """--check-weight-hash-across-dp-replicas-interval's check, in the metrics file."""
        if self.lead:
            self.metrics.write("weight-hash", iteration=it, tensors=tensors,
                               identical=not differ, differing=differ[:10])

    def summary(self, plan: ExecutionPlan, start: int) -> dict:
        times, losses = self.times, self.losses
        steady = sorted(times[1:] or times)
        median_ms = steady[len(steady) // 2] if steady else float("nan")
        tokens_per_iter = plan.global_batch_size * self.seq_length
        summary = {
            "iterations": len(losses), "first_iteration": start + 1,
            "last_iteration": self.last_record["iteration"] if self.last_record else start,
            "final_loss": losses[-1] if losses else None,
            "median_iteration_ms": median_ms,
            "tokens_per_s": tokens_per_iter / (median_ms / 1e3) if steady else None,
            "world": plan.world_size, "pipelines": len(plan.pipelines),
            "stages": len(plan.pipelines[0].stages),
        }
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.lead:
            print("-" * 72)
            print(f" training summary: {summary['iterations']} iterations "
                  f"({summary['first_iteration']}..{summary['last_iteration']}) on {plan.world_size} ranks "
                  f"({layout_text(plan)})")
            if losses:
                print(f"   loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
                print(f"   median iteration time: {median_ms:.1f} ms, "
                      f"throughput: {summary['tokens_per_s']:.0f} tokens/s")
            if self.events:
                cut = self.events[-1][0]
                pre = sorted(times[1:self.events[0][0]])
                post = sorted(times[cut + 1:])
                if pre and post:
                    b, after = pre[len(pre) // 2], post[len(post) // 2]
                    print(f"   {len(self.events)} transition(s); iteration time {b:.1f} ms "
                          f"before the first, {after:.1f} ms after the last ({after / b:.2f}x)")
                    summary.update(before_ms=b, after_ms=after)
            print("-" * 72, flush=True)
        return summary

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.metrics.close()
        self.tb.close()


def differing(everyone: list[dict[str, str]]) -> list[str]:
    """The names (sorted) of the tensors whose copies differ, from every rank's digests."""
    seen: dict[str, set[str]] = {}
    for digests in everyone:
        for name, d in digests.items():
            seen.setdefault(name, set()).add(d)
    return sorted(n for n, ds in seen.items() if len(ds) > 1)


def cuda_memory() -> dict[str, float]:
    """--log-memory-to-tensorboard: Megatron-LM's four figures of CUDA's caching allocator."""
    import torch
    stats = torch.cuda.memory_stats()
    return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"]}


def schedule_line(schedule) -> str:
    kinds = {op.kind for ops in schedule.ops.values() for op in ops}
    messages, packed = message_count(schedule)
    return (f"> schedule: {'backward split, ' if OpKind.BWD_WEIGHT in kinds else ''}"
            f"{messages} point-to-point messages per iteration, {packed} of them packed")


def layout_text(plan: ExecutionPlan) -> str:
    depths = [len(p.stages) for p in plan.pipelines]
    if len(set(depths)) == 1:
        return f"pipeline {depths[0]} x data {len(depths)}"
    return f"{len(depths)} pipelines of {'+'.join(map(str, depths))} stages"


def _what(d, plan: ExecutionPlan, resume: int, moved_bytes: int) -> str:
    """What the strategy made of the plan, in one line."""
    if d.restarts:
        return ((f"checkpoint of iteration {resume}" if resume else
                 "no checkpoint: back to iteration 0 and the initial weights")
                + f" loaded onto {layout_text(plan)}" + (f", since {d.why}" if d.why else ""))
    if d.strategy in ("takeover", "reparallelize", "rejoin", "substitute"):
        return "; ".join(f"pipeline {pi} now {len(p.stages)} stage(s): " + ", ".join(
            f"layers [{st.layer_start}, {st.layer_end}) on rank(s) {st.ranks}" for st in p.stages)
            + f", {len(p.micro_batches)} micro-batch(es)" for pi, p in enumerate(plan.pipelines)) \
            + f"; {moved_bytes / 2**20:.2f} MiB of parameters and optimizer state moved from " \
            "replicas"
    rerouted = "; ".join(f"micro-batch(es) of pipeline {pi} stage {si} now on rank(s) "
                         f"{sorted({r for rs in st.hosts.values() for r in rs})}"
                         for pi, p in enumerate(plan.pipelines)
                         for si, st in enumerate(p.stages) if not st.ranks)
    return rerouted or f"{layout_text(plan)} on {plan.world_size} ranks"
