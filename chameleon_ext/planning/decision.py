"""The leader's decision at a reconfiguration, as it travels on the store: typed, with a JSON
round trip.

Every rank of a reconfiguration reads the same `Verdict` (published once by the agreement's
leader under ``gen/{g}/pub/plan``): either a `Decision` (the strategy, the new plan and what the
planner predicted for it) or the reason why no plan can continue in-process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from chameleon_ext.plan.execution_plan import ExecutionPlan


@dataclass
class Switch:
    """A hybrid's planned second step: after the checkpoint of `at_iteration` the job moves to
    `plan` by `strategy` (a restart from that checkpoint)."""

    strategy: str
    at_iteration: int
    plan: ExecutionPlan
    predicted_iter_ms: float

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "at_iteration": self.at_iteration,
                "plan": self.plan.to_dict(), "predicted_iter_ms": self.predicted_iter_ms}

    @classmethod
    def from_dict(cls, d: dict) -> "Switch":
        return cls(d["strategy"], int(d["at_iteration"]), ExecutionPlan.from_dict(d["plan"]),
                   float(d["predicted_iter_ms"]))


@dataclass
class Decision:
    """What the new world runs.

    `strategy` names how the state gets there: "restart" loads the latest checkpoint; every
    other strategy carries the ranks' state over (layers new to a rank come from a replica).
    `members` are the launch ranks of the new world in rank order (new rank i is members[i]:
    with tensor parallelism a lost rank's whole group leaves, so the world is not always a
    prefix of the survivors; empty: the first plan.world_size of them).
    `candidates` are the planner's ranked summaries (the metrics file's `recovery.candidates`);
    `joined` are the launch ranks an admission admitted. What a member without state (a joiner,
    a spare taking a place) takes from the stayers: `scheduler` and `consumed_samples`, the LR
    schedule's state and the samples count; `pending`, the names of the actions the stayers
    still run at this iteration boundary (the interrupted one first) and whether they are
    the job's final ones (`finishing`): after a failure, the least advanced stayer's, which
    every stayer resumes from too; `admissions`, the admissions made so far."""

    strategy: str
    plan: ExecutionPlan
    predicted_iter_ms: float | None = None
    switch: Switch | None = None
    candidates: list[dict] = field(default_factory=list)
    profile: str | None = None
    scheduler: dict | None = None
    consumed_samples: int | None = None
    joined: list[int] = field(default_factory=list)
    members: list[int] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    admissions: int = 0
    why: str | None = None      # why a restart was the only choice (the state is gone)
    finishing: bool = False

    @property
    def restarts(self) -> bool:
        """Whether the new world starts from the latest checkpoint instead of the ranks' state."""
        return self.strategy == "restart"

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "plan": self.plan.to_dict(),
                "predicted_iter_ms": self.predicted_iter_ms,
                "switch": None if self.switch is None else self.switch.to_dict(),
                "candidates": self.candidates, "profile": self.profile,
                "scheduler": self.scheduler, "consumed_samples": self.consumed_samples,
                "joined": self.joined, "members": self.members, "pending": self.pending,
                "admissions": self.admissions, "why": self.why, "finishing": self.finishing}

    @classmethod
    def from_dict(cls, d: dict) -> "Decision":
        return cls(d["strategy"], ExecutionPlan.from_dict(d["plan"]), d.get("predicted_iter_ms"),
                   None if d.get("switch") is None else Switch.from_dict(d["switch"]),
                   list(d.get("candidates") or []), d.get("profile"), d.get("scheduler"),
                   d.get("consumed_samples"), [int(r) for r in d.get("joined") or []],
                   [int(r) for r in d.get("members") or []],
                   [str(a) for a in d.get("pending") or []], int(d.get("admissions") or 0),
                   d.get("why"), bool(d.get("finishing")))


@dataclass
class Verdict:
    """The published outcome of the leader's choice: a decision, or why there is none."""

    decision: Decision | None = None
    unrecoverable: str | None = None   # no plan fits the survivors: the reason, in one line

    def __post_init__(self) -> None:
        if (self.decision is None) == (self.unrecoverable is None):
            raise ValueError("a verdict holds either a decision or the reason there is none")

    def to_json(self) -> str:
        return json.dumps({"decision": None if self.decision is None else self.decision.to_dict(),
                           "unrecoverable": self.unrecoverable})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Verdict":
        d = json.loads(text)
        return cls(None if d["decision"] is None else Decision.from_dict(d["decision"]),
                   d.get("unrecoverable"))
