"""The elastic part of a job's configuration: what in-process recovery (`--chameleon`) does, and
every bound on its waits, in seconds.

megatron.training.config's JobConfig holds it as `elastic`; it lives here, beside the manager
that reads it, because imports flow from megatron.training to megatron.elastic and never back.
The relations between the timeouts are checked once, when it is built (`Timeouts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from chameleon_ext.control.faults import FaultSpec
from megatron.elastic.emulation import STORAGE_MIB_PER_S

Strategy = Literal["auto", "reroute", "takeover", "reparallelize", "restart", "reroute+restart",
                   "substitute"]
Redundancy = Literal["none", "eager"]
ShardRedundancy = Literal["none", "buddy"]
Executor = Literal["ir", "megatron-core"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flags, in one line."""


@dataclass(frozen=True)
class Timeouts:
    """Every bound on a wait of an elastic job, in seconds.

    A survivor learns of a loss in one of three ways, and each later wait must outlast the one
    before it, or a live rank is taken for a lost one: its current operation times out
    (`comm_s`), its peer's agent sees the peer silent (`heartbeat_s`) or stalled (`progress_s`);
    then every survivor meets in the agreement (`agree_s`). Hence, checked here:
    heartbeat_s <= progress_s < agree_s, heartbeat_s < agree_s, comm_s <= agree_s and
    comm_s <= save_s.
    """

    # A worker's heartbeat older than this makes its agent kill it (a stopped process). The
    # launcher's `--heartbeat-timeout` (default 5 s), read from CHAMELEON_HEARTBEAT_TIMEOUT: the
    # agent applies it, the worker only needs it to bound its other waits.
    heartbeat_s: float = 5.0
    # Every operation of a world's groups (--chameleon-comm-timeout): a peer silent longer is
    # lost. 5 s: a step's slowest op on a loaded host takes well under a second, and a false
    # alarm costs one re-run iteration, a late one every survivor's wait.
    comm_s: float = 5.0
    # How long a rank may go without progress (an op, a phase of a transition) while a peer
    # waits, before its agent takes it for hung (--chameleon-progress-timeout). None: the
    # larger of `heartbeat_s` and 10 x the median iteration measured so far (60 s while the
    # first three iterations warm up).
    progress_s: float | None = None
    # The operations of a checkpoint save or load, and the progress of their phases
    # (--chameleon-save-timeout): writing a shard may take far longer than any op. 300 s: far
    # beyond a shard's write at a node's share of a parallel file system
    # (emulation.STORAGE_MIB_PER_S), for one that is loaded or shared.
    save_s: float = 300.0
    # Each wait on the store of a reconfiguration (the agreement, the leader's plan, the
    # barrier before the new world) and a step's commit vote (--chameleon-agree-timeout): a live
    # survivor arrives within its current collective's timeout (`comm_s`) plus one recovery,
    # so 60 s leaves a loaded host an order of magnitude of slack.
    agree_s: float = 60.0
    # A new world's rendezvous, from the barrier to every participant connected, and the
    # creation of each of its plan's groups (--chameleon-rendezvous-timeout); it gives up at
    # once when a participant is reported lost, so the bound only ends a silent stall. 60 s:
    # process-group creation on a loaded host takes seconds.
    rendezvous_s: float = 60.0
    # How long a restarted worker waits to be admitted into the running job
    # (--chameleon-join-timeout): admissions happen at iteration boundaries, and the job may be
    # in a checkpoint save or a recovery meanwhile. 600 s covers both with slack.
    join_s: float = 600.0

    def __post_init__(self) -> None:
        for flag, value in (("--heartbeat-timeout", self.heartbeat_s),
                            ("--chameleon-comm-timeout", self.comm_s),
                            ("--chameleon-progress-timeout", self.progress_s),
                            ("--chameleon-save-timeout", self.save_s),
                            ("--chameleon-agree-timeout", self.agree_s),
                            ("--chameleon-rendezvous-timeout", self.rendezvous_s),
                            ("--chameleon-join-timeout", self.join_s)):
            if value is not None and not value > 0:
                raise ConfigError(f"{flag} must be positive (seconds), not {value:g}")
        hb = f"chameleon-launch's --heartbeat-timeout {self.heartbeat_s:g} s"
        if self.progress_s is not None:
            if self.progress_s < self.heartbeat_s:
                raise ConfigError(f"--chameleon-progress-timeout {self.progress_s:g} s is below "
                                  f"{hb}: a rank's progress is published with its heartbeat")
            if self.progress_s >= self.agree_s:
                raise ConfigError(f"--chameleon-progress-timeout {self.progress_s:g} s is not "
                                  f"below --chameleon-agree-timeout {self.agree_s:g} s: the "
                                  "agreement would give up before a hung rank is killed")
        if self.heartbeat_s >= self.agree_s:
            raise ConfigError(f"{hb} is not below --chameleon-agree-timeout {self.agree_s:g} s: "
                              "the agreement would give up before a silent rank is counted out")
        if self.comm_s > self.agree_s:
            raise ConfigError(f"--chameleon-comm-timeout {self.comm_s:g} s is above "
                              f"--chameleon-agree-timeout {self.agree_s:g} s: a survivor blocked "
                              "in a collective would reach the agreement after it gave up")
        if self.save_s < self.comm_s:
            raise ConfigError(f"--chameleon-save-timeout {self.save_s:g} s is below "
                              f"--chameleon-comm-timeout {self.comm_s:g} s: a save's operations "
                              "would be allowed less than a step's")


@dataclass(frozen=True)
class ElasticConfig:
    """In-process recovery from lost ranks, and the planning and emulation it uses."""

    enabled: bool = False                    # --chameleon: recover in-process from lost ranks
    strategy: Strategy = "auto"              # --chameleon-strategy (its --help says each one)
    # --chameleon-redundancy: eager keeps each stage's state on an adjacent stage too
    redundancy: Redundancy = "none"
    # --chameleon-shard-redundancy: buddy keeps each distributed-optimizer shard on a second
    # rank of its replica group too (megatron.elastic.buddy_copies)
    shard_redundancy: ShardRedundancy = "none"
    # --chameleon-mtbf: the planner's horizon (None: the failure rate observed in this job)
    mtbf_hours: float | None = None
    # --chameleon-repair-minutes: how long a lost slot takes to come back (None: measured from
    # this job's rejoins; before the first, the launcher's restart delay below)
    repair_minutes: float | None = None
    # chameleon-launch's --restart-delay in seconds where it restarts lost workers (None: it
    # does not, or says nothing: a zero delay)
    restart_delay_s: float | None = None
    profile: str | None = None               # --chameleon-profile: a profile to plan with first
    emulate: str | None = None               # --chameleon-emulate: the emulated device's profile
    emulate_storage_mib_per_s: float = STORAGE_MIB_PER_S    # --chameleon-emulate-storage
    emulate_dilation: float = 1.0            # --chameleon-emulate-dilation
    inject: tuple[FaultSpec, ...] = ()       # --chameleon-inject, every rank's faults
    executor: Executor = "ir"                # --chameleon-executor: who runs each iteration
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def eager(self) -> bool:
        return self.redundancy == "eager"
