"""Recovery strategies: each turns a plan and its lost ranks into a plan over the survivors.

One protocol (`base.Strategy`) and one registry, which the planner (every strategy's proposal,
predicted, under `auto`) and a forced --chameleon-strategy both use.
"""

from chameleon_ext.planning.strategies.base import Context, Proposal, Strategy
from chameleon_ext.planning.strategies.reparallelize import Reparallelize
from chameleon_ext.planning.strategies.reroute import Reroute
from chameleon_ext.planning.strategies.restart import Restart
from chameleon_ext.planning.strategies.substitute import Substitute
from chameleon_ext.planning.strategies.takeover import Takeover

REGISTRY: dict[str, Strategy] = {s.name: s for s in (Reroute(), Takeover(), Reparallelize(),
                                                     Restart(), Substitute())}

__all__ = ["REGISTRY", "Context", "Proposal", "Strategy"]
