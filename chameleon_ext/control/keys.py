"""The job's store: its key layout, the environment a launched worker reads, failure causes.

Store key layout (all keys below the ``chameleon/`` root; values are UTF-8 text or JSON)::

    chameleon/job                      JSON {"world_size", "nnodes", "nproc_per_node",
                                       "heartbeat_timeout", "started"}       (node-0 agent)
    chameleon/worker/{rank}            JSON {"rank", "local_rank", "node", "host", "pid", "pgid",
                                       "agent_pid", "started"}   (set by the agent when it starts
                                       the worker; inject_failure.py reads it)
    chameleon/node/{node}              JSON {"node", "host", "agent_pid", "ranks", "started"}
    chameleon/agent_hb/{node}          wall time (time.time()) of the node agent's last heartbeat
    chameleon/agent_done/{node}        set when that agent has finished (not a node loss)
    chameleon/agent_left/{node}        set when that agent has read the store for the last time
                                       (an agent that hosts the store waits for it)
    chameleon/hb/{rank}                wall time of the worker's last heartbeat; "off:<time>" once
                                       it stopped heartbeating on purpose (Heartbeat.stop)
    chameleon/progress/{rank}          JSON Progress: what the worker's main thread is doing
                                       (iteration, a counter bumped at every op, phase, whether it
                                       waits on peers), written with each heartbeat
    chameleon/failure/{rank}           JSON FailureRecord; the first report wins (compare_set)
    chameleon/failures                 append log "r,r,..." of reported ranks (may repeat)
    chameleon/dying/{rank}             wall time an injected fault is about to stop the rank (its
                                       own announcement, to measure detection)
    chameleon/exit/{rank}              JSON {"rank", "exitcode": 0, "time"}: a clean exit
    chameleon/exits                    append log "r,r,..." of cleanly exited ranks
    chameleon/abort                    reason text: the job is being stopped (--max-failures)
    chameleon/generation               the latest agreed generation (set by its leader)
    chameleon/gen/{g}/arrived/{rank}   JSON {"time", "iteration"}: a rank's arrival at agreement g
                                       and the last iteration whose step it applied
    chameleon/gen/{g}/arrivals         append log "r,r,..." of arrived ranks
    chameleon/gen/{g}/final            JSON Agreement, written once (compare_set) by the leader
    chameleon/gen/{g}/pub/{key}        bytes published for generation g (e.g. the plan JSON)
    chameleon/gen/{g}/ready/{rank}     the rank is about to build generation g's world
    chameleon/gen/{g}/noticed          wall time the first rank saw generation g - 1's world break
    chameleon/gen/{g}/retry            JSON next generation: g's world could not be built (a
                                       participant failed meanwhile); everyone agrees again there
    chameleon/gen/{g}/committed        g's world is built and holds the state (its leader, after
                                       the first collective); ranks g's plan left out are spares
    chameleon/gen/{g}/commit/{i}/votes counter: ranks of generation g ready to apply step i
    chameleon/gen/{g}/commit/{i}/decision  "commit" or "abort", written once (compare_set)
    chameleon/next_member              counter: a restarted worker's rank is world_size + its
                                       value (set by the agent that restarts it)
    chameleon/joins                    append log "r,r,..." of ranks asking to join
    chameleon/admission/{n}            JSON {"after": iteration, "joiners": [...], "action":
                                       "now"|"checkpoint"|"spare"}: the n-th admission, at the
                                       end of that iteration (its leader)
    chameleon/admit/{rank}             JSON {"generation", "candidates", "admission"}: where a
                                       joiner meets the others
    chameleon/trained                  the last iteration, once the job trained it (its lead): no
                                       boundary is left to admit a joiner at; spares leave
"""

STORE_ENV = "CHAMELEON_STORE"
HEARTBEAT_ENV = "CHAMELEON_HEARTBEAT_TIMEOUT"
JOIN_ENV = "CHAMELEON_JOIN"     # "1": a restarted worker, joining a running job
JOIN_AT_ENV = "CHAMELEON_JOIN_AT"  # a restarted worker asks to join from this time (epoch s) on
# the launcher's --restart-delay in seconds, where it restarts failed workers (--max-restarts)
# after one: how long a lost slot stays empty, for the planner's repair time
RESTART_DELAY_ENV = "CHAMELEON_RESTART_DELAY"
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
ROOT = "chameleon"

CAUSES = ("exit", "signal", "hang", "comm", "node")


def key_job() -> str:
    return f"{ROOT}/job"


def key_worker(rank: int) -> str:
    return f"{ROOT}/worker/{rank}"


def key_node(node: int) -> str:
    return f"{ROOT}/node/{node}"


def key_agent_hb(node: int) -> str:
    return f"{ROOT}/agent_hb/{node}"


def key_agent_done(node: int) -> str:
    return f"{ROOT}/agent_done/{node}"


def key_agent_left(node: int) -> str:
    return f"{ROOT}/agent_left/{node}"


def key_hb(rank: int) -> str:
    return f"{ROOT}/hb/{rank}"


def key_failure(rank: int) -> str:
    return f"{ROOT}/failure/{rank}"


KEY_FAILURES = f"{ROOT}/failures"
KEY_EXITS = f"{ROOT}/exits"
KEY_ABORT = f"{ROOT}/abort"
KEY_GENERATION = f"{ROOT}/generation"


KEY_NEXT_MEMBER = f"{ROOT}/next_member"
KEY_JOINS = f"{ROOT}/joins"
KEY_TRAINED = f"{ROOT}/trained"


def key_admission(n: int) -> str:
    return f"{ROOT}/admission/{n}"


def key_admit(rank: int) -> str:
    return f"{ROOT}/admit/{rank}"


def key_dying(rank: int) -> str:
    return f"{ROOT}/dying/{rank}"


def key_exit(rank: int) -> str:
    return f"{ROOT}/exit/{rank}"


def key_progress(rank: int) -> str:
    return f"{ROOT}/progress/{rank}"


def gen_prefix(generation: int) -> str:
    return f"{ROOT}/gen/{generation}"
