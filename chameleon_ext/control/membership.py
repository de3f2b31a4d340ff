"""Membership over torch's c10d store: one handle on the protocols a process speaks with the job.

The protocols talk to the job's store, never to a process group: a broken process group cannot be
used to agree on how to replace it (chameleon_ext.control.store says which stores; keys.py lists
every key). world.py alone creates and destroys process groups. Workers and agents use the same
protocols, one module each:

    heartbeat.py    heartbeats, progress, and the losses their ages reveal
    failures.py     failure records and clean exits
    agreement.py    the survivors' agreement on a generation's alive list
    step_vote.py    the vote that applies an optimizer step everywhere or nowhere
    generations.py  a generation's publication, barrier and outcome
    admission.py    joiners: asking, scheduling, admitting
    world.py        building a generation's process groups and tearing a world down
"""

from __future__ import annotations

import os

import torch.distributed as dist

from chameleon_ext.control.admission import Admissions
from chameleon_ext.control.agreement import Agreements
from chameleon_ext.control.failures import FailureLog
from chameleon_ext.control.generations import Generations
from chameleon_ext.control.heartbeat import Heartbeat
from chameleon_ext.control.step_vote import StepVote
from chameleon_ext.control.store import Member, connect_store


class Membership(Member):
    """One process's view of the job's membership (a worker: rank >= 0; an observer: rank
    None), as one object per protocol over the same store connection."""

    def __init__(self, store: dist.Store, rank: int | None, world_size: int,
                 heartbeat_timeout: float | None = None):
        super().__init__(store, rank, world_size, heartbeat_timeout)
        self.heartbeat = Heartbeat(self)
        self.failure_log = FailureLog(self)
        self.agreements = Agreements(self, self.failure_log, self.heartbeat)
        self.step_vote = StepVote(self, self.failure_log)
        self.generations = Generations(self, self.failure_log)
        self.admissions = Admissions(self, self.failure_log)

    @classmethod
    def from_env(cls, store: dist.Store | None = None,
                 heartbeat_timeout: float | None = None) -> "Membership":
        """A launched worker's membership: RANK, WORLD_SIZE and CHAMELEON_STORE from its
        environment; the heartbeat timeout as given (the job's config), else from
        CHAMELEON_HEARTBEAT_TIMEOUT."""
        return cls(store if store is not None else connect_store(),
                   int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), heartbeat_timeout)
