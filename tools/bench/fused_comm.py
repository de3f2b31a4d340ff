"""Packed messages for rerouted traffic: gloo step time, and the fused kernels against torch ops.

(a) A rerouted step on gloo: 1 + P local processes (127.0.0.1, one thread each; P = 2 and 4);
    rank 0 sends to P peers, per peer K tensors (K micro-batches of [seq, mb, hidden] float32 activations), either
    as K separate isend/irecv or as one packed message per peer (pack on the sender, unpack, i.e.
    views, on the receiver). A step's time is the slowest rank's, from a barrier to the end of
    its last wait. Variants alternate round by round; medians over all steps.
(b) pack and scale_accumulate (chameleon_ext.comm.packed, whichever backend it uses) against the torch
    ops a caller would write otherwise: torch.cat of flattened views, and a loop of
    dst.add_(src, alpha) (src.float() for a bf16 source). Alternating repetitions; medians.
(c) The messages per iteration of the schedules the executor runs after a loss, with and without
    the fused messages chameleon_ext.schedule.message_fusion chose.

    python tools/bench/fused_comm.py [--rounds 10] [--steps 20] [--reps 21] [--k 8] [--peers 2 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from chameleon_ext.comm import packed as comm  # noqa: E402
from chameleon_ext.plan.execution_plan import ExecutionPlan  # noqa: E402
from chameleon_ext.planning.strategies.reroute import reroute  # noqa: E402
from chameleon_ext.schedule.choice import choose_schedule  # noqa: E402
from chameleon_ext.schedule.ir import Schedule  # noqa: E402
from chameleon_ext.schedule.message_fusion import message_count  # noqa: E402
from chameleon_ext.schedule.simulator import UniformCosts, simulate  # noqa: E402



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- (a) gloo ------------------------------------------------------------------------------------
def _step_separate(rank, acts, recv_bufs):
    if rank == 0:
        reqs = [dist.isend(t, peer) for peer in acts for t in acts[peer]]
    else:
        reqs = [dist.irecv(b, 0) for b in recv_bufs]
    for r in reqs:
        r.wait()
    return recv_bufs


def _step_packed(rank, acts, recv_buf, packer):
    if rank == 0:
        bufs = {peer: packer(ts) for peer, ts in acts.items()}
        reqs = [dist.isend(b, peer) for peer, b in bufs.items()]
        for r in reqs:
            r.wait()
        return None
    dist.irecv(recv_buf, 0).wait()
    return comm.unpack(recv_buf)


def _worker(rank, port, world, shape, k, rounds, steps, out_path):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    peers = range(1, world)
    try:
        gen = torch.Generator().manual_seed(rank)
        acts = {peer: [torch.randn(shape, generator=gen) for _ in range(k)] for peer in peers}
        recv_bufs = [torch.empty(shape) for _ in range(k)]
        recv_packed = torch.empty(comm.packed_nbytes([(shape, torch.float32)] * k),
                                  dtype=torch.uint8)
        variants = {
            "separate": lambda: _step_separate(rank, acts, recv_bufs),
            "packed": lambda: _step_packed(rank, acts, recv_packed, comm.pack),
            "packed-torch": lambda: _step_packed(rank, acts, recv_packed, comm._torch_pack),
        }
        names = list(variants)
        # Correctness once: what arrives is what was sent.
        for name in names:
            dist.barrier()
            got = variants[name]()
            if rank != 0:
                sent_gen = torch.Generator().manual_seed(0)
                sent = {p: [torch.randn(shape, generator=sent_gen) for _ in range(k)]
                        for p in peers}
                assert all(torch.equal(a, b) for a, b in zip(got, sent[rank])), name
        for _ in range(3):  # warm-up
            for name in names:
                dist.barrier()
                variants[name]()
        times = {name: [] for name in names}
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                for _ in range(steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    variants[name]()
                    times[name].append(time.perf_counter() - t0)
        # The slowest rank per step.
        slowest = {}
        for name in names:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[name] = t.tolist()
        if rank == 0:
            torch.save(slowest, out_path)
    finally:
        dist.destroy_process_group()


def bench_gloo(peers, shape, k, rounds, steps):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(_worker, args=(_free_port(), peers + 1, shape, k, rounds, steps, out),
                 nprocs=peers + 1, join=True)
        return torch.load(out)


# ---- (b) kernels ---------------------------------------------------------------------------------
def _time_per_call(fn, inner):
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def compare(fused, baseline, reps, inner):
    fused(), baseline()  # warm-up
    a, b = [], []
    for r in range(reps):
        if r % 2 == 0:
            a.append(_time_per_call(fused, inner))
            b.append(_time_per_call(baseline, inner))
        else:
            b.append(_time_per_call(baseline, inner))
            a.append(_time_per_call(fused, inner))
    return statistics.median(a), statistics.median(b)


def bench_kernels(reps):
    rows = []
    configs = [((128, 2, 256), 8, 50), ((4, 256), 64, 200)]
    for shape, k, inner in configs:
        gen = torch.Generator().manual_seed(0)
        label = f"{k} x {list(shape)}"
        ts = [torch.randn(shape, generator=gen) for _ in range(k)]

        def cat():
            return torch.cat([t.reshape(-1) for t in ts])

        rows.append(("pack", "torch.cat(flattened views)", label + " f32",
                     *compare(lambda: comm.pack(ts), cat, reps, inner)))
        for src_dtype in (torch.float32, torch.bfloat16):
            srcs = [t.to(src_dtype) for t in ts]
            buf = comm.pack(srcs)
            views = comm.unpack(buf)
            dst_a = [torch.zeros(shape) for _ in range(k)]
            dst_b = [torch.zeros(shape) for _ in range(k)]
            scale = 1.0 / 8.0

            def loop(dst=dst_b, views=views, f32=src_dtype == torch.float32):
                for d, s in zip(dst, views):
                    d.add_(s if f32 else s.float(), alpha=scale)

            def fused(dst=dst_a, buf=buf):
                comm.scale_accumulate(dst, buf, scale)

            name = "f32" if src_dtype == torch.float32 else "bf16"
            base = "loop dst.add_(src, alpha)" if src_dtype == torch.float32 else \
                "loop dst.add_(src.float(), alpha)"
            rows.append(("scale_accumulate", base, f"{label} {name} -> f32",
                         *compare(fused, loop, reps, inner)))
            assert all(torch.equal(a, b) for a, b in zip(dst_a, dst_b))  # same calls, same bits
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="alternating rounds of (a)")
    p.add_argument("--steps", type=int, default=20, help="steps per variant and round in (a)")
    p.add_argument("--reps", type=int, default=21, help="repetitions per kernel in (b)")
    p.add_argument("--k", type=int, default=8, help="micro-batches per peer in (a)")
    p.add_argument("--peers", type=int, nargs="+", default=[2, 4], help="peers of rank 0 in (a)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    print(f"chameleon_ext.comm.packed backend: {comm.backend()}"
          + (f" (cpu loops: {comm._C.cpu_variant()})" if comm._C is not None else
             f" ({comm._EXT_REASON})") + f"; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads in (b)", flush=True)

    print("\n(a) rerouted traffic per step on gloo: 1 + peers processes on 127.0.0.1, 1 thread "
          "each; rank 0 -> every peer")
    print(f"{'peers':>5} | {'payload per peer':<32} | {'variant':<23} | {'msgs/step':>9} | "
          f"{'median ms/step':>14} | {'separate / variant':>18}")
    for peers in args.peers:
        for shape, k in (((128, 2, 256), args.k), ((16, 1, 256), args.k)):
            times = bench_gloo(peers, shape, k, args.rounds, args.steps)
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            mib = k * torch.Size(shape).numel() * 4 / 2 ** 20
            payload = f"{k} x {list(shape)} f32 ({mib:.2f} MiB)" if mib >= 0.1 else \
                f"{k} x {list(shape)} f32 ({mib * 1024:.0f} KiB)"
            labels = {"separate": ("separate isend/irecv", peers * k),
                      "packed": (f"packed ({comm.backend()})", peers),
                      "packed-torch": ("packed (torch fallback)", peers)}
            for name, (label, msgs) in labels.items():
                print(f"{peers:>5} | {payload:<32} | {label:<23} | {msgs:>9} | "
                      f"{med[name]:14.3f} | {med['separate'] / med[name]:17.2f}x", flush=True)
                payload = ""

    print("\n(c) the executor's rerouted schedules (list scheduler, fused by the simulator at no "
          "simulated cost): point-to-point messages per iteration")
    print(f"{'layout, lost rank':<26} | {'unfused':>7} | {'fused':>5} | {'packed':>6} | "
          f"{'simulated time':>14}")
    for world, pp, mbs, lost in ((4, 2, 16, 3), (6, 2, 24, 5), (8, 4, 16, 5), (8, 2, 32, 7),
                                 (16, 4, 32, 9)):
        plan = reroute(ExecutionPlan.failure_free(world, 1, pp, 4, 1, mbs), {lost})
        fused = choose_schedule(plan)
        plain = Schedule(fused.ops)
        before, _ = message_count(plain)
        after, packed = message_count(fused)
        same = simulate(plan, fused, UniformCosts()).iteration_time == \
            simulate(plan, plain, UniformCosts()).iteration_time
        print(f"{f'PP{pp} x DP{world // pp}, rank {lost}':<26} | {before:>7} | {after:>5} | "
              f"{packed:>6} | {'unchanged' if same else 'CHANGED':>14}", flush=True)

    print(f"\n(b) kernels ({comm.backend()}) against the equivalent torch ops, "
          f"median of {args.reps} alternating repetitions")
    print(f"{'op':<17} | {'baseline':<33} | {'data':<31} | {'fused us':>9} | {'torch us':>9} | "
          f"{'torch / fused':>13}")
    for op, base, data, fused_s, torch_s in bench_kernels(args.reps):
        print(f"{op:<17} | {base:<33} | {data:<31} | {fused_s * 1e6:9.1f} | {torch_s * 1e6:9.1f}"
              f" | {torch_s / fused_s:12.2f}x", flush=True)
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
