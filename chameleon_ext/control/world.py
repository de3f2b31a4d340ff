"""The one place of the control plane that creates and destroys process groups: a generation's
world is built on the store after its agreement, and a broken (or finished) world is torn down.

Process groups of generation g rendezvous on ``PrefixStore(f"gen{g}", store)`` (see
``generation_store`` and ``rebuild_world``); the first world is generation 0 (pretrain_gpt.py
meets on ``gen0``; a script may use ``env://`` on a TCPStore instead, whose keys live under
``default_pg/``), so no prefix is ever reused.

A survivor's recovery, in order (tests/dist/test_launcher.py runs it, with a bare
``destroy_process_group``)::

    store = connect_store(); m = Membership.from_env(store); m.heartbeat.start()
    ...
    except RuntimeError:                      # a collective failed ("Connection reset by peer")
        destroy_world()                       # FIRST: closing our sockets makes peers that are
                                              # still blocked in the collective fail at once
        ag = m.agreements.agree(generation + 1, alive)   # on the store, never on the broken group
        new_rank = rebuild_world(store, ag, old_rank)    # PrefixStore(f"gen{g}", store)
        generation, alive = ag.generation, ag.alive

Without the teardown, a survivor that is not a TCP neighbour of the dead rank may wait in the
collective until another survivor exits (or the group timeout), and agreement times out on it.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from chameleon_ext.control.agreement import Agreement
from chameleon_ext.control.failures import LOSS_CHECK_S, FailureLog
from chameleon_ext.control.keys import gen_prefix
from chameleon_ext.control.poll import poll
from chameleon_ext.control.store import MembershipError, generation_store

if TYPE_CHECKING:
    from chameleon_ext.control.membership import Membership


def destroy_world() -> None:
    """Destroy the default group and every group of its world. Destroyed groups sit in
    reference cycles and only their collection closes their sockets, which is what makes peers
    still blocked on this rank fail now instead of at their timeout; it also runs while the
    interpreter is whole (gloo's threads joined at its teardown end in std::terminate). Callers
    drop their own references to the world's groups first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def rebuild_world(store: dist.Store, agreement: Agreement, old_rank: int, backend: str = "gloo",
                  timeout_s: float = 60.0, members: "Membership | None" = None) -> int:
    """Destroy the current world (if any) and create the agreement's world on
    PrefixStore(f"gen{g}", store); returns this rank's new rank. With `members`, the
    rendezvous (of this world and of every group created in it later) gives up at once when a
    rank of the agreement is lost meanwhile (RendezvousStore), instead of after `timeout_s`."""
    global _rendezvous
    if dist.is_initialized():
        destroy_world()
    new_rank = agreement.new_rank(old_rank)
    rdzv = generation_store(store, agreement.generation) if members is None else \
        RendezvousStore(members.failure_log, agreement.generation, agreement.alive, timeout_s)
    # A Python store must outlive the groups that hold it (they keep only its C++ half).
    _rendezvous = rdzv
    dist.init_process_group(backend, store=rdzv, rank=new_rank,
                            world_size=agreement.world_size, timeout=timedelta(seconds=timeout_s))
    return new_rank


_rendezvous: dist.Store | None = None


class PeerLost(MembershipError):
    """A rendezvous gave up: a rank it waits for was reported failed or exited, the
    generation was abandoned, or its time ran out."""


class RendezvousStore(dist.Store):
    """The rendezvous store of generation g's process groups: PrefixStore(f"gen{g}", store)
    whose blocking reads (gloo's connection set-up, every new_group) poll, and raise PeerLost
    as soon as a rank of the generation is lost or the generation is abandoned, so a failure
    during a reconfiguration costs milliseconds, not the rendezvous timeout. Used from the
    thread that builds the world (it shares that thread's store connection). Only reported
    losses count (failure records, exits): every lost rank gets a record from an agent (its own
    for a death or a hang, another node's for a lost node). Heartbeat ages are no evidence
    here: creating the groups of 8 ranks on 2 loaded cores stalled the agent's TCPStore for
    5 s (measured), which made every heartbeat, node 0's agent's included, look old and ended
    generation 0, which has no earlier world to go back to."""

    def __init__(self, failure_log: FailureLog, generation: int, ranks: list[int],
                 timeout_s: float) -> None:
        super().__init__()
        self._failure_log, self._generation, self._ranks = failure_log, generation, list(ranks)
        self._inner = generation_store(failure_log.member.store, generation)
        self._timeout_s = timeout_s

    def _await(self, keys: list[str]) -> None:
        next_check = time.monotonic() + LOSS_CHECK_S   # most keys come within it: no look

        def look() -> bool | None:
            nonlocal next_check
            if self._inner.check(keys):
                return True
            now = time.monotonic()
            if now >= next_check:
                self._check(keys)
                next_check = now + LOSS_CHECK_S
            return None

        if poll(look, self._timeout_s, 0.001, grow=2.0, max_interval_s=0.01) is None:
            raise PeerLost(f"rendezvous of generation {self._generation}: keys {keys} not "
                           f"set within {self._timeout_s:g} s")

    def _check(self, keys: list[str]) -> None:
        if self._failure_log.member.store.check([f"{gen_prefix(self._generation)}/retry"]):
            raise PeerLost(f"generation {self._generation} was abandoned while its groups "
                           "were being created")
        gone = self._failure_log.gone(self._ranks)
        if gone:
            raise PeerLost(f"rank(s) {gone} of generation {self._generation} lost "
                           f"while its groups were being created (waiting for {keys})")

    def set(self, key, value):
        self._inner.set(key, value)

    def get(self, key):
        self._await([key])
        return self._inner.get(key)

    def wait(self, keys, timeout=None):
        self._await(list(keys))

    def check(self, keys):
        return self._inner.check(keys)

    def add(self, key, value):
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        pass   # every blocking read is bounded by the reconfiguration's timeout instead
