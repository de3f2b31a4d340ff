"""--save/--load with torch.distributed.checkpoint, keyed by layout-independent names.

Each parameter and its Adam moments are stored under the parameter's global name (layer i is
`decoder.layers.i...` whichever stage holds it), so a checkpoint written under one plan loads under
any plan with the same model and tensor-parallel size; replicas write a key once (DCP dedups).
The distributed optimizer's slices of the moments are saved whole under the same keys
(megatron.elastic.sharded_state), so its checkpoints load under any data-parallel size and
either optimizer.
The LR scheduler, iteration, consumed samples and the model's flags (for
--use-checkpoint-args) go to meta.json. RNG state is not needed (--no-load-rng changes nothing):
dropout is reseeded from (seed, iteration, micro-batch, layer).

Atomic: a checkpoint is written to `iter_N.tmp/`, renamed to `iter_N/` once complete, and only
then named in `latest_checkpointed_iteration.txt` (Megatron's tracker file). A killed save leaves at
most a `.tmp` directory that loading ignores.

A save or load can take far longer than a training step's collectives may wait, so an elastic
job runs it on a world group of its own with a longer bound (parallel_state.RankGroups.storage,
made with the plan's groups), passed to torch.distributed.checkpoint (`process_group=`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.elastic import sharded_state, state_transfer
from megatron.elastic.schedules import StageRuntime

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    pass


def _dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _state_dict(rt: StageRuntime, tied_embeddings: bool, create_missing: bool,
                optimizer: bool = True, saving: bool = False) -> dict:
    """`saving` the distributed optimizer's state: its whole moments gathered (collective);
    else zeroed whole tensors for a load to fill (then `_load_slices`)."""
    params = state_transfer.named_parameters(rt, tied_embeddings)
    sd: dict[str, torch.Tensor] = {f"model/{k}": p.data for k, p in params.items()}
    if not optimizer:
        return sd
    by_id = {id(p): k for k, p in params.items()}
    if sharded_state.is_sharded(rt.optimizer):
        whole = sharded_state.whole_state(rt.optimizer, by_id, gathered=saving)
        sd.update({f"optim/{name}/{k}": v for name, state in whole.items()
                   for k, v in state.items()})
        return sd
    for opt in state_transfer.torch_optimizers(rt.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if create_missing and not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        sd[f"optim/{by_id[id(p)]}/{k}"] = v
    return sd


def save(root: str, iteration: int, rt: StageRuntime, *, tied_embeddings: bool, meta: dict,
         group: dist.ProcessGroup | None = None,
         written: Callable[[], None] | None = None, retain_interval: int | None = None) -> Path:
    """Collective over `group` (None: the world); `written`: called once this rank's part is
    written, before the checkpoint is named (failure injection). With `retain_interval`
    (--save-retain-interval) the checkpoint before this one is deleted once this one is named,
    unless its iteration is a multiple of it."""
    final = _dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    sharded_state.gather_parameters(rt)
    dcp.save(_state_dict(rt, tied_embeddings, create_missing=True, saving=True),
             checkpoint_id=str(tmp), process_group=group)
    if written:
        written()
    dist.barrier(group=group)
    if rank0:
        full_meta = {**meta, "iteration": iteration, "scheduler": rt.scheduler.state_dict()}
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        tracker = Path(root) / TRACKER
        before = latest_iteration(root) if retain_interval else None
        t = tracker.with_suffix(".tmp")
        t.write_text(str(iteration))
        t.replace(tracker)
        if before is not None and before != iteration and before % retain_interval:
            shutil.rmtree(_dir(root, before), ignore_errors=True)
    # No barrier after the tracker: a rank lost here cannot undo a checkpoint that is complete
    # and named, and the job's next collective finds the loss anyway.
    return final


def latest_iteration(root: str) -> int | None:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} does not hold an iteration number: {text[:40]!r}")
    it = int(text)
    if not (_dir(root, it) / "meta.json").is_file():
        raise CheckpointError(f"{tracker} names iteration {it}, but {_dir(root, it)} is incomplete")
    return it


def _latest_meta(root: str) -> tuple[Path, dict] | None:
    it = latest_iteration(root)
    if it is None:
        return None
    d = _dir(root, it)
    try:
        return d, json.loads((d / "meta.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{d / 'meta.json'} is not valid JSON: {e}") from None


def model_args(root: str) -> dict | None:
    """The model flags (ModelConfig fields) the latest checkpoint under `root` was trained
    with, for --use-checkpoint-args; None if there is no checkpoint."""
    found = _latest_meta(root)
    if found is None:
        return None
    d, meta = found
    if "model_args" not in meta:
        raise CheckpointError(f"checkpoint {d} records no model arguments")
    return meta["model_args"]


# The schedule settings a checkpoint records that megatron-core's scheduler checks on load
_SCHEDULE_SETTINGS = {"max_lr": "learning rate", "min_lr": "minimum learning rate",
                      "lr_warmup_steps": "warm-up samples", "lr_decay_steps": "decay samples",
                      "lr_decay_style": "decay style", "start_wd": "start weight decay",
                      "end_wd": "end weight decay", "wd_incr_steps": "weight-decay samples",
                      "wd_incr_style": "weight-decay increment style"}


def schedule_mismatch(scheduler, saved: dict) -> str | None:
    """What megatron-core's scheduler would assert on loading `saved` (Megatron-LM's default:
    the flags and the checkpoint agree), as one line naming the way out; None when it loads."""
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return None
    for key, what in _SCHEDULE_SETTINGS.items():
        if key in saved and saved[key] != getattr(scheduler, key):
            return (f"its {what} is {saved[key]!r}, the flags give {getattr(scheduler, key)!r}: "
                    "pass --override-opt_param-scheduler to take the flags' schedule or "
                    "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    return None


def load(root: str, rt: StageRuntime, *, tied_embeddings: bool, expect: dict,
         group: dist.ProcessGroup | None = None, optimizer: bool = True,
         scheduler: bool = True) -> dict | None:
    """Load the latest checkpoint under `root` into the runtime (collective); returns its meta,
    or None if there is none. `expect` holds model settings that must match the
    checkpoint's; `group` as for save; without `optimizer` (--no-load-optim, --finetune)
    the Adam state stays fresh, without `scheduler` (--finetune) the LR schedule too."""
    found = _latest_meta(root)
    if found is None:
        return None
    d, meta = found
    for k, v in expect.items():
        if meta.get(k) != v:
            raise CheckpointError(f"checkpoint {d} has {k}={meta.get(k)!r}, this run has {v!r}")
    if scheduler:
        differs = schedule_mismatch(rt.scheduler, meta["scheduler"])
        if differs:
            raise CheckpointError(f"checkpoint {d}: {differs}")
    sd = _state_dict(rt, tied_embeddings, create_missing=True, optimizer=optimizer)
    dcp.load(sd, checkpoint_id=str(d), process_group=group)
    if optimizer and sharded_state.is_sharded(rt.optimizer):
        names = {id(p): k for k, p in state_transfer.named_parameters(rt,
                                                                     tied_embeddings).items()}
        sharded_state.load_slices(rt.optimizer, names, {
            name: {k: sd[f"optim/{name}/{k}"] for k in ("step", *sharded_state.MOMENTS)}
            for name in set(names.values())})
    if scheduler:
        rt.scheduler.load_state_dict(meta["scheduler"])
    return meta
