"""The simulator: runs lowered programs under a cost model and proves them correct.

It is the oracle of the test-suite. A program it accepts is complete (every micro-batch
gets one forward and one backward per chunk on its route), ordered (no work before the
data it needs has been computed and received) and deadlock-free. It also reports what a
user plans with: makespan, bubble ratio, busy time, in-flight activations and weights.

Execution model: a rank runs its ops in order, one compute at a time, each after
``dispatch`` of the runtime's own host time. Sends are non-blocking; a message arrives
``comm`` after it is posted. Receives block. A gradient sync is posted without blocking
and completes ``allreduce`` after its last member posts (its data-parallel copies, outside
the program, post alike); a SYNC_WAIT waits for it. A global CLIP is a collective of every
rank (their norms are summed). Ranks are advanced by an event-driven worklist, so the cost
is linear in the number of ops.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..schedules.actions import (BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, Action, ClipGrads, ClipScope,
                                 CommBatch, Gather, GradSync, OptimizerStep, Release, SyncWait)
from ..schedules.costs import UNIT_COSTS, Costs  # noqa: F401  (Costs is part of the simulator's API)
from ..schedules.lowering import Program, gc_paused


@dataclass
class SimResult:
    schedule: str
    stages: int
    micro_batches: int
    chunks: int
    makespan: float
    ideal: float
    busy: list
    peak_activations: list
    weights_per_rank: list
    errors: list = field(default_factory=list)
    deadlock: dict = field(default_factory=dict)
    records: list = field(default_factory=list)   # (rank, kind, chunk, mb, start, end)
    sync_records: list = field(default_factory=list)   # (rank, stage, post, done)
    gathers: list = field(default_factory=list)         # sharded programs: chunk all-gathers per rank
    peak_gathered: list = field(default_factory=list)   # ... most gathered weights at once, in stage units

    @property
    def valid(self) -> bool:
        return not self.errors and not self.deadlock

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - self.ideal / self.makespan if self.makespan > 0 else 0.0

    def summary(self) -> dict:
        return {
            "schedule": self.schedule, "stages": self.stages, "micro_batches": self.micro_batches,
            "chunks": self.chunks, "makespan": round(self.makespan, 9), "ideal": self.ideal,
            "bubble_ratio": round(self.bubble_ratio, 9), "busy": [round(b, 9) for b in self.busy],
            "peak_activations": [round(a, 9) for a in self.peak_activations],
            "weights_per_rank": self.weights_per_rank, "valid": self.valid,
            "errors": self.errors[:20], "deadlock": {str(k): v for k, v in self.deadlock.items()},
            **({"gathers": self.gathers, "peak_gathered": [round(g, 9) for g in self.peak_gathered]}
               if self.gathers else {}),
        }

    def start_times(self) -> dict:
        """(kind, chunk, mb) -> start time, for schedules built by merging timed pieces."""
        return {(k, c, m): s for (_, k, c, m, s, _) in self.records}


def simulate(program: Program, costs: Costs = Costs(), chunks_per_rank: int = 1,
             max_errors: int = 100, data_parallel: int = 1) -> SimResult:
    """Execute ``program`` under ``costs``; never raises on a bad program, it reports it.

    ``data_parallel``: copies of the whole pipeline the gradient syncs also span (outside the
    program, which is one pipeline's): with more than one, a sync over a single stage replica
    still costs ``allreduce`` (the reduce-scatter under sharding)."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"simulate: data_parallel must be an integer >= 1, got {data_parallel!r}")
    with gc_paused():
        return _simulate(program, costs, chunks_per_rank, max_errors, data_parallel)


def _simulate(program: Program, costs: Costs, chunks_per_rank: int, max_errors: int,
              data_parallel: int) -> SimResult:
    placement = program.placement
    num_ranks = placement.num_ranks
    size = placement.size
    chunk_rank = [c.rank for c in placement.chunks]
    chunk_stage = [c.stage for c in placement.chunks]
    chunk_replica = [c.replica for c in placement.chunks]
    nxt = [placement.next_chunk(c) for c in range(len(chunk_rank))]
    prv = [placement.prev_chunk(c) for c in range(len(chunk_rank))]
    mb_replica = placement.mb_replica
    num_mbs = len(mb_replica)
    cost_of = {k: costs.of(k) * size for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)}
    cost_of[STEP] = costs.step * size

    errors: list = []

    def error(msg):
        if len(errors) < max_errors:
            errors.append(msg)

    nch = len(chunk_rank)
    # end time of each (kind, chunk, mb), flat-indexed chunk * N + mb; None until it has run
    f_end, b_end, i_end, w_end, s_end = ([None] * (nch * num_mbs) for _ in range(5))
    ends = {FORWARD: f_end, BACKWARD: b_end, INPUT_GRAD: i_end, WEIGHT_GRAD: w_end, STEP: s_end}
    got_act, got_grad = bytearray(nch * num_mbs), bytearray(nch * num_mbs)   # received by the consumer
    messages: dict = {}                 # Message -> arrival time
    edge_sent: dict = {}                # (kind, src, dst) -> micro-batches in send order
    edge_recv: dict = {}                # ... in receive order: NCCL matches them by order
    routed = [placement.micro_batches_of(c.replica) for c in placement.chunks]
    stage_chunks_on = [{} for _ in range(num_ranks)]
    for c in placement.chunks:
        stage_chunks_on[c.rank].setdefault(c.stage, []).append(c.index)
    msg_waiter: dict = {}
    sync_posts: dict = {}               # (stage, k) -> {rank: time}
    sync_groups: dict = {}              # (stage, k) -> ranks
    sync_waiters: dict = {}
    posted = [dict() for _ in range(num_ranks)]    # stage -> times posted by this rank
    own_syncs = [[] for _ in range(num_ranks)]     # keys posted by rank, not yet awaited
    clip_round = [0] * num_ranks                   # global clips each rank has reached
    clip_posted = [-1] * num_ranks                 # op index of the rank's current global clip
    clip_arrivals: dict = {}                       # clip round -> {rank: arrival time}
    stepped = [set() for _ in range(num_ranks)]    # chunks each rank stepped with an OptimizerStep
    sharded = any(type(op) is Gather for ops in program.ops for op in ops)
    resident = [dict() for _ in range(num_ranks)]  # sharded: chunk -> time its gathered weights are there
    gathers, gathered_peak = [0] * num_ranks, [0.0] * num_ranks
    group_orders: dict = {}             # (group, rank) -> stages in posting order

    pc = [0] * num_ranks
    clock = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    live = [0.0] * num_ranks
    peak = [0.0] * num_ranks
    sends_posted = [-1] * num_ranks
    records: list = []
    sync_records: list = []
    work = deque(range(num_ranks))
    queued = [True] * num_ranks

    def wake(rank):
        if not queued[rank]:
            queued[rank] = True
            work.append(rank)

    def sync_done_time(key):
        posts = sync_posts[key]
        if len(posts) < len(sync_groups[key]):
            return None
        return max(posts.values()) + (costs.allreduce if len(posts) * data_parallel > 1 else 0.0)

    while work:
        r = work.popleft()
        queued[r] = False
        ops = program.ops[r]
        i, t = pc[r], clock[r]
        while i < len(ops):
            op = ops[i]
            if type(op) is Action:
                kind, c, mb = op
                if not (0 <= c < nch) or not (0 <= mb < num_mbs):
                    error(f"rank {r}: {op} names an unknown chunk or micro-batch")
                    i += 1
                    continue
                if chunk_rank[c] != r:
                    error(f"rank {r}: runs {op} but chunk {c} lives on rank {chunk_rank[c]}")
                if chunk_replica[c] != mb_replica[mb]:
                    error(f"rank {r}: {op}: micro-batch {mb} does not flow through chunk {c}")
                idx = c * num_mbs + mb
                mine = ends[kind] if kind in ends else None
                if mine is None:
                    error(f"rank {r}: unknown action kind {kind!r}")
                    i += 1
                    continue
                if mine[idx] is not None:
                    error(f"rank {r}: {op} runs twice")
                if sharded:
                    ready = resident[r].get(c)
                    if ready is None:
                        error(f"rank {r}: {op} computes without chunk {c}'s weights (no GATHER, or after RELEASE)")
                    elif ready > t:
                        t = ready
                if kind == FORWARD:
                    p = prv[c]
                    if p is not None:
                        if f_end[p * num_mbs + mb] is None:
                            error(f"rank {r}: {op} runs before the forward of chunk {p}")
                        elif chunk_rank[p] != r and not got_act[idx]:
                            error(f"rank {r}: {op} runs without receiving its activation")
                    live[r] += size
                    if live[r] > peak[r]:
                        peak[r] = live[r]
                elif kind == BACKWARD or kind == INPUT_GRAD:
                    if f_end[idx] is None:
                        error(f"rank {r}: {op} runs before its forward")
                    n = nxt[c]
                    if n is not None:
                        nidx = n * num_mbs + mb
                        if b_end[nidx] is None and i_end[nidx] is None:
                            error(f"rank {r}: {op} runs before the backward of chunk {n}")
                        elif chunk_rank[n] != r and not got_grad[idx]:
                            error(f"rank {r}: {op} runs without receiving its gradient")
                    if kind == BACKWARD:
                        live[r] -= size
                elif kind == WEIGHT_GRAD:
                    if i_end[idx] is None:
                        error(f"rank {r}: {op} runs before its input-grad")
                    live[r] -= size
                else:   # STEP: one chunk's optimizer step, after a SYNC_WAIT of its stage
                    if b_end[idx] is None and w_end[idx] is None:
                        error(f"rank {r}: {op} steps before micro-batch {mb}'s gradient exists")
                    unawaited = [key for key in own_syncs[r] if key[0] == chunk_stage[c]]
                    if unawaited:
                        error(f"rank {r}: {op} steps while the gradient sync of stage {chunk_stage[c]} is "
                              f"still pending (no SYNC_WAIT before it)")
                t += costs.dispatch
                dt = cost_of[kind]
                records.append((r, kind, c, mb, t, t + dt))
                t += dt
                busy[r] += dt
                mine[idx] = t
            elif type(op) is CommBatch:
                if sends_posted[r] != i:
                    sends_posted[r] = i
                    for m in op.sends:
                        mkind, src, dst, mb = m
                        if chunk_rank[src] != r:
                            error(f"rank {r}: sends {m} but chunk {src} lives on rank {chunk_rank[src]}")
                        sidx = src * num_mbs + mb
                        ready = f_end[sidx] is not None if mkind == "act" else \
                            (b_end[sidx] is not None or i_end[sidx] is not None)
                        if not ready:
                            error(f"rank {r}: sends {m} before computing it")
                        if m in messages:
                            error(f"rank {r}: sends {m} twice")
                        t += costs.send
                        messages[m] = t + costs.comm
                        edge_sent.setdefault((mkind, src, dst), []).append(mb)
                        waiter = msg_waiter.pop(m, None)
                        if waiter is not None:
                            wake(waiter)
                missing = None
                for m in op.recvs:
                    if m not in messages:
                        missing = m
                        break
                if missing is not None:
                    msg_waiter[missing] = r
                    break
                for m in op.recvs:
                    if chunk_rank[m.dst] != r:
                        error(f"rank {r}: receives {m} but chunk {m.dst} lives on rank {chunk_rank[m.dst]}")
                    edge_recv.setdefault((m.kind, m.src, m.dst), []).append(m.mb)
                    flags = got_act if m.kind == "act" else got_grad
                    ridx = m.dst * num_mbs + m.mb
                    if flags[ridx]:
                        error(f"rank {r}: receives {m} twice")
                    flags[ridx] = 1
                    if messages[m] > t:
                        t = messages[m]
                    t += costs.recv
            elif type(op) is GradSync:
                # a synchronous program syncs a stage once, after all its backwards; an asynchronous
                # one syncs before every step, which checks its own micro-batch's backward
                for c in stage_chunks_on[r].get(op.stage, ()) if program.synchronous else ():
                    for mb in routed[c]:
                        idx = c * num_mbs + mb
                        if b_end[idx] is None and w_end[idx] is None:
                            error(f"rank {r}: posts the gradient sync of stage {op.stage} before the backward "
                                  f"of micro-batch {mb} on chunk {c}")
                            break
                t += costs.sync_post          # the all-reduce is under way once its post returns
                times = posted[r].setdefault(op.stage, [])
                skey = (op.stage, len(times))
                times.append(t)
                group = tuple(op.ranks)
                group_orders.setdefault((group, r), []).append(op.stage)
                if r not in group:
                    error(f"rank {r}: posts the sync of stage {op.stage} for group {group} it is not in")
                known = sync_groups.setdefault(skey, group)
                if known != group:
                    error(f"rank {r}: sync of stage {op.stage} over {group}, others use {known}")
                sync_posts.setdefault(skey, {})[r] = t
                own_syncs[r].append(skey)
                if sync_done_time(skey) is not None:
                    for waiter in sync_waiters.pop(skey, ()):
                        wake(waiter)
            elif type(op) is SyncWait:
                pending = None
                finish = t
                waited = [key for key in own_syncs[r] if key[0] in op.stages]
                for skey in waited:
                    when = sync_done_time(skey)
                    if when is None:
                        pending = skey
                        break
                    finish = max(finish, when)
                if pending is not None:
                    sync_waiters.setdefault(pending, []).append(r)
                    break
                for skey in waited:
                    sync_records.append((r, skey[0], sync_posts[skey][r], sync_done_time(skey)))
                own_syncs[r] = [key for key in own_syncs[r] if key[0] not in op.stages]
                t = finish
            elif type(op) is ClipGrads:
                if op.scope == ClipScope.GLOBAL:
                    # a collective of every rank: the squared norms are summed over the pipeline
                    if clip_posted[r] != i:         # first visit: this rank arrives
                        clip_posted[r] = i
                        clip_round[r] += 1
                        arrived = clip_arrivals.setdefault(clip_round[r], {})
                        arrived[r] = t
                        if len(arrived) == num_ranks:
                            for other in range(num_ranks):
                                wake(other)
                    arrived = clip_arrivals[clip_round[r]]
                    if len(arrived) < num_ranks:
                        break
                    t = max(t, max(arrived.values()) + costs.clip)
                elif op.stage not in stage_chunks_on[r]:
                    error(f"rank {r}: clips stage {op.stage}, which it does not hold")
            elif type(op) is Gather:
                if not 0 <= op.chunk < nch or chunk_rank[op.chunk] != r:
                    error(f"rank {r}: gathers chunk {op.chunk}, which it does not hold")
                elif op.chunk in resident[r]:
                    error(f"rank {r}: gathers chunk {op.chunk} while its weights are already gathered")
                else:
                    t += costs.gather_post
                    # posted: it overlaps what follows, and ends ``gather`` after the later peer's post
                    resident[r][op.chunk] = t + costs.gather_skew + costs.gather * size
                    gathers[r] += 1
                    gathered_peak[r] = max(gathered_peak[r], len(resident[r]) * size)
            elif type(op) is Release:
                if resident[r].pop(op.chunk, None) is None:
                    error(f"rank {r}: releases chunk {op.chunk}, whose weights are not gathered")
            elif type(op) is OptimizerStep:
                for c in op.chunks:
                    if not 0 <= c < nch or chunk_rank[c] != r:
                        error(f"rank {r}: steps chunk {c}, which it does not hold")
                t += costs.step * size * len(op.chunks)
                stepped[r].update(op.chunks)
                if own_syncs[r]:
                    error(f"rank {r}: steps the optimizer while the gradient syncs of stages "
                          f"{sorted({key[0] for key in own_syncs[r]})} are still pending (no SYNC_WAIT before it)")
            else:
                error(f"rank {r}: unknown op {op!r}")
            i += 1
        pc[r], clock[r] = i, t

    deadlock = {}
    for r in range(num_ranks):
        if pc[r] < len(program.ops[r]):
            deadlock[r] = _describe_wait(program, r, pc[r], messages, sync_posts, sync_groups)
    if not deadlock:
        _check_complete(placement, ends, num_mbs, error)
        for edge, order in edge_sent.items():
            if edge_recv.get(edge, []) != order:
                error(f"messages {edge[0]} {edge[1]}->{edge[2]} are received in another order than sent "
                      f"({edge_recv.get(edge, [])[:6]} vs {order[:6]}); NCCL would pair them wrongly")
        if program.synchronous:
            for r in range(num_ranks):
                never = sorted(set(placement.chunks_on(r)) - stepped[r])
                if never:
                    error(f"rank {r} never steps the optimizer on chunks {never} (a synchronous program ends "
                          f"with SYNC_WAIT, CLIP and STEP)")
                for stage in stage_chunks_on[r]:
                    if len(placement.stage_group(stage)) > 1 and not posted[r].get(stage):
                        error(f"rank {r} never posts the gradient sync of replicated stage {stage}")
        for (group, r), stages in group_orders.items():
            for other in group:
                if group_orders.get((group, other), []) != stages:
                    error(f"ranks {r} and {other} post the syncs of group {group} in different orders")
                    break

    ideal = num_mbs * (costs.fwd + costs.bwd)
    return SimResult(program.name, num_ranks, num_mbs, chunks_per_rank, max(clock) if clock else 0.0,
                     ideal, busy, peak, program.weights or placement.weights_per_rank(), errors, deadlock, records,
                     sync_records, gathers if sharded else [], gathered_peak if sharded else [])


def _describe_wait(program, rank, index, messages, sync_posts, sync_groups) -> str:
    op = program.ops[rank][index]
    placement = program.placement
    if type(op) is CommBatch:
        missing = [m for m in op.recvs if m not in messages]
        return "; ".join(f"waits for {m.kind} of micro-batch {m.mb} from chunk {m.src} "
                         f"on rank {placement.rank_of(m.src)}" for m in missing) or "waits in a comm batch"
    if type(op) is ClipGrads:
        return f"op {index} ({op}) waits for every rank to reach its global clip"
    if type(op) in (SyncWait, Action):
        waits = [f"stage {stage} sync from ranks {sorted(set(sync_groups[(stage, n)]) - set(posts))}"
                 for (stage, n), posts in sync_posts.items()
                 if rank in posts and len(posts) < len(sync_groups[(stage, n)])]
        return f"op {index} ({op}) waits for " + ("; ".join(waits) or "gradient syncs")
    return f"stuck at op {index}: {op!r}"


def _check_complete(placement, ends, num_mbs, error) -> None:
    f_end, b_end, i_end, w_end = ends[FORWARD], ends[BACKWARD], ends[INPUT_GRAD], ends[WEIGHT_GRAD]
    for mb, replica in enumerate(placement.mb_replica):
        for c in placement.routes[replica]:
            idx = c * num_mbs + mb
            if f_end[idx] is None:
                error(f"micro-batch {mb} never runs forward on chunk {c}")
            full = b_end[idx] is not None
            split = i_end[idx] is not None, w_end[idx] is not None
            if full and any(split):
                error(f"micro-batch {mb} runs both a full and a split backward on chunk {c}")
            elif not full and not all(split):
                error(f"micro-batch {mb} never completes its backward on chunk {c}")
