"""Store operations per second on loopback: the agent's TCPStore against a 3-member etcd cluster.

One client, one thread, each operation in a loop for a fixed time: set, get, check, compare_set
(a failing one: the common case, e.g. a second failure report), add, append, and multi_get of 16
keys. etcd runs as the tests run it (tests/etcd_cluster.py: fsync on, loopback), so its numbers
include a Raft round trip and a WAL fsync per write.

    python tools/bench/store_ops.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from chameleon_ext.control.store import connect_store  # noqa: E402
from tests.etcd_cluster import EtcdCluster  # noqa: E402

KEYS = [f"k{i}" for i in range(16)]


def rates(store, seconds: float) -> dict[str, float]:
    for k in KEYS:
        store.set(k, "v")
    store.set("cas", "taken")
    ops = {
        "set": lambda i: store.set("k0", str(i)),
        "get": lambda i: store.get("k1"),
        "check": lambda i: store.check(["k2"]),
        "compare_set": lambda i: store.compare_set("cas", "", "mine"),
        "add": lambda i: store.add("counter", 1),
        "append": lambda i: store.append("log", "1,"),
        "multi_get(16)": lambda i: store.multi_get(KEYS),
    }
    out = {}
    for name, op in ops.items():
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            op(n)
            n += 1
        out[name] = n / (time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per operation and store")
    a = p.parse_args(argv)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30),
                           wait_for_workers=False)
    tcp = rates(connect_store(f"127.0.0.1:{server.port}"), a.seconds)
    with tempfile.TemporaryDirectory(prefix="store_ops_") as tmp:
        cluster = EtcdCluster(Path(tmp))
        try:
            etcd = rates(connect_store(cluster.url("bench")), a.seconds)
        finally:
            cluster.stop()
    print(f"{'operation':<15}{'TCPStore op/s':>15}{'etcd op/s':>12}{'etcd ms/op':>12}")
    for name in tcp:
        print(f"{name:<15}{tcp[name]:>15.0f}{etcd[name]:>12.0f}{1e3 / etcd[name]:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
