"""chameleon-launch's settings: one typed record, built once from its command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """What one node's agent runs and how it watches it. Invalid values raise ValueError whose
    message names the flag, as the command line spells it."""

    training_script: str
    training_script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1             # workers on this node (the same on every node)
    nnodes: int = 1                     # a fixed number of nodes
    node_rank: int = 0
    master_addr: str = "127.0.0.1"      # host of the node-0 agent's store
    master_port: int = 29500            # its port (0: any free port, one node only)
    max_failures: int = 4               # worker failures the job tolerates before it is stopped
    max_restarts: int = 0               # failed workers this node's agent starts again
    restart_delay_s: float = 0.0        # how long a failed worker's slot stays empty first
    # How long before the delay ends the replacement starts; it asks to join only when the
    # delay has passed, so its start-up (imports, set-up) is not counted in the delay.
    start_ahead_s: float = 0.0
    # How long a heartbeat (a worker's, a node agent's) may be silent before its owner counts
    # as lost: a hung worker is killed, a silent node's ranks are reported.
    heartbeat_timeout_s: float = 5.0
    store: str | None = None            # an external store (HOST:PORT, etcd://...); None: host one
    store_timeout_s: float = 60.0       # bounds connecting to the store (and a blocking read on it)
    # After this long, a node whose agent never wrote a heartbeat counts as lost: its host
    # may take a while to start, but a job cannot wait for a node forever.
    join_timeout_s: float = 600.0
    grace_s: float = 5.0                # between SIGTERM and SIGKILL when stopping workers
    log_dir: str | None = None          # each worker's stdout/stderr under it (and echoed)
    no_python: bool = False             # run the training script as an executable
    module: bool = False                # the training script is a python module (python -m)
    # What the workers' fork server imports once before it forks them (forkserver.py): by
    # default this stack's workers' libraries; () for none.
    preload: tuple[str, ...] = ("megatron.training.preload",)

    def __post_init__(self) -> None:
        for flag, value in (("--nproc-per-node", self.nproc_per_node), ("--nnodes", self.nnodes)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not in 0..{self.nnodes - 1}")
        if self.max_failures < 0 or self.max_restarts < 0 or self.restart_delay_s < 0 or \
                self.start_ahead_s < 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("--max-failures, --max-restarts, --restart-delay and --start-ahead "
                             "must be >= 0 and --heartbeat-timeout > 0")
        if self.store:
            # here, not at the module's top: the launcher builds its config before torch is
            # imported (launcher.main), and only --store needs the store module
            from chameleon_ext.control.store import check_store_spec
            try:
                check_store_spec(self.store)
            except ValueError as e:
                raise ValueError(f"--store: {e}") from None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes
