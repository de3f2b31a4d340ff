"""The upkeep of buddy copies (--chameleon-shard-redundancy buddy) over a plain step.

Failure-free jobs of N emulated ranks (default pipeline 2 x data 4, an 8-layer GPT, the
analytical H200 profile of a 1.3B GPT's shape at dilation X) with --use-distributed-optimizer
and one instance, without and with buddy copies, alternated (--repeats of each). Prints each
run's median iteration time (the first two iterations left out as warm-up), the medians of
each setting, and the buddy's upkeep as their ratio.

The emulated optimizer step is padded to the performance model's time for the job's sharding
(perf_model.ProfileCosts: a shard's step, twice with a buddy copy) and the gradient reduction
to its time with the part of the owner's gradient message that waits (perf_model.
buddy_message_ms: with --overlap-grad-reduce the last bucket's part, or a tied embedding's, sent
after its sum over the first and last stages), so the upkeep shown is the model's cost of the
copy as the emulated devices run it; what the emulation does not charge is said beside the
result. --untie-embeddings-and-output-weights unties the job's and the profile's embeddings
(Llama-style).

    python tools/bench/buddy_upkeep.py [--pipeline 2] [--data 4] [--dilation 60] [--repeats 2]
        [--overlap-grad-reduce] [--untie-embeddings-and-output-weights]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chameleon_ext.planning.perf_model import analytical_profile  # noqa: E402
from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tests.launch import SMALL_MODEL, run_chameleon  # noqa: E402
from tools.reproduce import executed  # noqa: E402

LAYERS = 8
MICRO_BATCHES = 4                      # per pipeline, of SMALL_MODEL's 2 samples
PROG = "buddy_upkeep.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", type=int, default=2)
    p.add_argument("--data", type=int, default=4)
    p.add_argument("--dilation", type=float, default=60.0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    a = p.parse_args(argv)
    if a.data < 2 or a.pipeline < 1 or a.dilation <= 0 or a.iters < 4 or a.repeats < 1:
        print(f"{PROG}: error: need --data >= 2 (a buddy is another replica), --pipeline >= 1, "
              "a positive --dilation, --iters >= 4 and --repeats >= 1", file=sys.stderr)
        return 2
    ranks = a.pipeline * a.data
    model = SMALL_MODEL[:]
    model[model.index("--num-layers") + 1] = str(LAYERS)
    untied = a.untie_embeddings_and_output_weights
    model += ["--overlap-grad-reduce"] * a.overlap_grad_reduce + \
        ["--untie-embeddings-and-output-weights"] * untied
    data = ensure_builtin_dataset(quiet=True, progress=False)
    medians: dict[str, list[float]] = {"none": [], "buddy": []}
    with tempfile.TemporaryDirectory(prefix="buddy-upkeep-") as tmp:
        work = Path(tmp)
        profile = work / "device.json"
        analytical_profile(replace(executed.DEFAULT_SHAPE, tied_embeddings=not untied),
                           "H200").save(profile)
        for i in range(a.repeats):
            for mode in ("none", "buddy"):      # alternated: a drift of the host hits both
                run = run_chameleon(ranks, model + [
                    "--pipeline-model-parallel-size", str(a.pipeline), "--global-batch-size",
                    str(2 * MICRO_BATCHES * a.data), "--train-iters", str(a.iters),
                    "--data-path", data, "--split", "100,0,0", "--log-interval", str(a.iters),
                    "--use-distributed-optimizer", "--chameleon",
                    "--chameleon-shard-redundancy", mode, "--chameleon-emulate", str(profile),
                    "--chameleon-emulate-dilation", str(a.dilation)], work, name=f"{mode}{i}",
                    # 10 minutes bound a run of a few seconds per iteration and the start of
                    # its processes on 2 shared cores; beyond, it is stuck
                    timeout=600, launcher_args=executed.LAUNCHER)
                if run.returncode != 0:
                    last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
                    print(f"{PROG}: error: the {mode} job exited with {run.returncode}: {last}",
                          file=sys.stderr)
                    return 1
                its = [e["elapsed_ms"] for e in run.metrics
                       if e["event"] == "iteration" and e["iteration"] > 2]
                emu = next(e for e in run.metrics if e["event"] == "emulation")
                medians[mode].append(statistics.median(its))
                print(f"{mode:5s} run {i + 1}: median iteration {medians[mode][-1]:.1f} ms, "
                      f"overruns {100 * emu['share']:.2f}% of padded ops"
                      + ("" if emu["valid"] else " (INVALID emulation: raise --dilation)"),
                      flush=True)
    plain, buddy = (statistics.median(medians[m]) for m in ("none", "buddy"))
    print(f"{ranks} emulated ranks (pipeline {a.pipeline} x data {a.data}, dilation "
          f"{a.dilation:g}), distributed optimizer, 1 instance"
          + (", overlapped gradient reduction" if a.overlap_grad_reduce else "")
          + (", untied embeddings" if untied else "") + f": median iteration {plain:.1f} ms "
          f"plain, {buddy:.1f} ms with buddy copies: upkeep {100 * (buddy / plain - 1):+.2f}%")
    print("not emulated: the gradient messages also cross this host's gloo, inside the padded "
          "reduction where they fit; this job's small model has fewer gradient buckets than the "
          "profile's shape, whose buckets the padding charges for")
    return 0


if __name__ == "__main__":
    sys.exit(main())
