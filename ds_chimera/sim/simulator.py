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

Each op type has one handler in :class:`_Simulation` (its time, its checks, whether the rank
must wait), as each has one in the executor's ``StepRun``: an op kind is one handler in each.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from ..schedules.actions import (BACKWARD, FORWARD, INPUT_GRAD, STAGE_STEP, WEIGHT_GRAD, Action, Clip, ClipScope,
                                 Comm, Gather, SyncStart, Step, Release, SyncWait)
from ..schedules.costs import Costs, StageCosts
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


def simulate(program: Program, costs: Costs = Costs(), chunks_per_rank: int = 1,
             max_errors: int = 100, data_parallel: int = 1, stage_costs: StageCosts | None = None,
             durations: dict | None = None) -> SimResult:
    """Execute ``program`` under ``costs``; never raises on a bad program, it reports it.

    ``data_parallel``: copies of the whole pipeline the gradient syncs also span (outside the
    program, which is one pipeline's): with more than one, a sync over a single stage replica
    still costs ``allreduce`` (the reduce-scatter under sharding).

    ``stage_costs``: each stage's own F, B, W and activation size (layers that differ); the
    peak activations are then in its unit, and the ideal is the whole model's work spread
    evenly over the ranks.

    ``durations``: ``(kind, chunk, mb)`` -> that action's own time, in place of the per-kind cost (a measured
    step replayed on its own op times: tools/step_breakdown.py); an action it does not name keeps its cost."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"simulate: data_parallel must be an integer >= 1, got {data_parallel!r}")
    if stage_costs is not None and stage_costs.num_stages != program.placement.num_stages:
        raise ValueError(f"simulate: stage_costs has {stage_costs.num_stages} stages, the program "
                         f"{program.placement.num_stages}")
    with gc_paused():
        return _simulate(program, costs, chunks_per_rank, max_errors, data_parallel, stage_costs, durations)


def _simulate(program: Program, costs: Costs, chunks_per_rank: int, max_errors: int,
              data_parallel: int, stage_costs=None, durations=None) -> SimResult:
    sim = _Simulation(program, costs, max_errors, data_parallel, stage_costs, durations)
    sim.run()
    return sim.result(chunks_per_rank)


_F, _B, _I, _W, _S = range(5)       # the compute kinds, as _action tells them apart


class _Simulation:
    """The state of one simulation, and one handler per op type (as the executor's ``StepRun``).

    A handler takes (rank, the op's index, the op, the rank's clock) and returns the rank's clock
    after the op, or None where the rank must wait: it has then saved the clock and registered the
    rank as a waiter, and the worklist takes the rank up again at the same op once it is woken.
    """

    __slots__ = ("program", "costs", "stage_costs", "durations", "act", "data_parallel", "max_errors", "placement",
                 "num_ranks", "size",
                 "chunk_rank", "chunk_stage", "chunk_replica", "nxt", "prv", "mb_replica", "num_mbs", "nch",
                 "kinds", "errors", "f_end", "b_end", "i_end", "w_end", "got_act", "got_grad",
                 "messages", "edge_sent", "edge_recv", "routed", "stage_chunks_on", "msg_waiter", "sync_posts",
                 "sync_groups", "sync_waiters", "posted", "own_syncs", "clip_round", "clip_posted",
                 "clip_arrivals", "stepped", "sharded", "resident", "gathers", "gathered_peak", "group_orders",
                 "pc", "clock", "busy", "live", "peak", "sends_posted", "records", "sync_records", "work",
                 "queued")

    def __init__(self, program: Program, costs: Costs, max_errors: int, data_parallel: int, stage_costs=None,
                 durations=None):
        self.program, self.costs, self.data_parallel, self.max_errors = program, costs, data_parallel, max_errors
        self.stage_costs, self.durations = stage_costs, durations
        placement = self.placement = program.placement
        num_ranks = self.num_ranks = placement.num_ranks
        size = self.size = placement.size
        self.chunk_rank = [c.rank for c in placement.chunks]
        self.chunk_stage = [c.stage for c in placement.chunks]
        self.chunk_replica = [c.replica for c in placement.chunks]
        nch = self.nch = len(self.chunk_rank)
        self.nxt = [placement.next_chunk(c) for c in range(nch)]
        self.prv = [placement.prev_chunk(c) for c in range(nch)]
        self.mb_replica = placement.mb_replica
        num_mbs = self.num_mbs = len(self.mb_replica)
        self.errors: list = []
        # end time of each (kind, chunk, mb), flat-indexed chunk * N + mb; None until it has run
        self.f_end, self.b_end, self.i_end, self.w_end, s_end = ([None] * (nch * num_mbs) for _ in range(5))
        # compute kind -> (its end times, its time on each chunk, its code for _action's branches)
        stages = self.chunk_stage
        if stage_costs is None:
            def times(kind):
                return [costs.of(kind) * size] * nch
            self.act = [size] * nch          # activations held per micro-batch, in rank-shares of layers
        else:
            def times(kind):
                return [stage_costs.of(kind, s) for s in stages]
            self.act = [stage_costs.activations[s] for s in stages]
        self.kinds = {FORWARD: (self.f_end, times(FORWARD), _F), BACKWARD: (self.b_end, times(BACKWARD), _B),
                      INPUT_GRAD: (self.i_end, times(INPUT_GRAD), _I),
                      WEIGHT_GRAD: (self.w_end, times(WEIGHT_GRAD), _W), STAGE_STEP: (s_end, [costs.step * size] * nch, _S)}
        self.got_act, self.got_grad = bytearray(nch * num_mbs), bytearray(nch * num_mbs)   # received by the consumer
        self.messages: dict = {}            # Message -> arrival time
        self.edge_sent = defaultdict(list)  # (kind, src, dst) -> micro-batches in send order
        self.edge_recv = defaultdict(list)  # ... in receive order: NCCL matches them by order
        self.routed = [placement.micro_batches_of(c.replica) for c in placement.chunks]
        self.stage_chunks_on = [{} for _ in range(num_ranks)]
        for c in placement.chunks:
            self.stage_chunks_on[c.rank].setdefault(c.stage, []).append(c.index)
        self.msg_waiter: dict = {}
        self.sync_posts: dict = {}          # (stage, k) -> {rank: time}
        self.sync_groups: dict = {}         # (stage, k) -> ranks
        self.sync_waiters: dict = {}
        self.posted = [dict() for _ in range(num_ranks)]     # stage -> times posted by this rank
        self.own_syncs = [[] for _ in range(num_ranks)]      # keys posted by rank, not yet awaited
        self.clip_round = [0] * num_ranks                    # global clips each rank has reached
        self.clip_posted = [-1] * num_ranks                  # op index of the rank's current global clip
        self.clip_arrivals: dict = {}                        # clip round -> {rank: arrival time}
        self.stepped = [set() for _ in range(num_ranks)]     # chunks each rank stepped with a Step
        self.sharded = any(type(op) is Gather for ops in program.ops for op in ops)
        self.resident = [dict() for _ in range(num_ranks)]   # sharded: chunk -> time its gathered weights are there
        self.gathers, self.gathered_peak = [0] * num_ranks, [0.0] * num_ranks
        self.group_orders: dict = {}        # (group, rank) -> stages in posting order
        self.pc = [0] * num_ranks
        self.clock = [0.0] * num_ranks
        self.busy = [0.0] * num_ranks
        self.live = [0.0] * num_ranks
        self.peak = [0.0] * num_ranks
        self.sends_posted = [-1] * num_ranks
        self.records: list = []
        self.sync_records: list = []
        self.work = deque(range(num_ranks))
        self.queued = [True] * num_ranks

    def handlers(self) -> dict:
        """Op type -> its handler, as the executor's ``StepRun.handlers`` (built per run: no reference cycle)."""
        return {Action: self._action, Comm: self._comm, SyncStart: self._grad_sync, SyncWait: self._sync_wait,
                Clip: self._clip, Step: self._step, Gather: self._gather, Release: self._release}

    def error(self, msg) -> None:
        if len(self.errors) < self.max_errors:
            self.errors.append(msg)

    def wake(self, rank) -> None:
        if not self.queued[rank]:
            self.queued[rank] = True
            self.work.append(rank)

    def run(self) -> None:
        """Advance the ranks, each as far as it can go, until every rank is done or waits (the event-driven worklist)."""
        handlers, unknown = self.handlers(), self._unknown
        program_ops, pc, clock, queued, work = self.program.ops, self.pc, self.clock, self.queued, self.work
        while work:
            r = work.popleft()
            queued[r] = False
            ops = program_ops[r]
            t = clock[r]
            # a for loop, not a while: its backward jump is what lets CPython 3.11 specialise this one call
            for i in range(pc[r], len(ops)):
                op = ops[i]
                try:
                    handler = handlers[type(op)]
                except KeyError:
                    handler = unknown
                t = handler(r, i, op, t)
                if t is None:       # it waits at op i; the handler saved its clock
                    pc[r] = i
                    break
            else:
                pc[r], clock[r] = len(ops), t

    def result(self, chunks_per_rank: int) -> SimResult:
        program, placement, clock = self.program, self.placement, self.clock
        deadlock = {}
        for r in range(self.num_ranks):
            if self.pc[r] < len(program.ops[r]):
                deadlock[r] = _describe_wait(program, r, self.pc[r], self.messages, self.sync_posts,
                                             self.sync_groups)
        if not deadlock:
            _check_complete(self)
        costs, sharded, stage_costs = self.costs, self.sharded, self.stage_costs
        ideal = self.num_mbs * (costs.fwd + costs.bwd) if stage_costs is None else \
            self.num_mbs * (sum(stage_costs.fwd) + sum(stage_costs.bwd)) / self.num_ranks
        return SimResult(program.name, self.num_ranks, self.num_mbs, chunks_per_rank, max(clock) if clock else 0.0,
                         ideal, self.busy, self.peak,
                         program.weights or placement.weights_per_rank(), self.errors, deadlock, self.records,
                         self.sync_records, self.gathers if sharded else [], self.gathered_peak if sharded else [])

    # ---- compute ------------------------------------------------------------------------------
    def _action(self, r, i, op, t):
        kind, c, mb = op
        num_mbs = self.num_mbs
        if not (0 <= c < self.nch) or not (0 <= mb < num_mbs):
            self.error(f"rank {r}: {op} names an unknown chunk or micro-batch")
            return t
        chunk_rank = self.chunk_rank
        if chunk_rank[c] != r:
            self.error(f"rank {r}: runs {op} but chunk {c} lives on rank {chunk_rank[c]}")
        if self.chunk_replica[c] != self.mb_replica[mb]:
            self.error(f"rank {r}: {op}: micro-batch {mb} does not flow through chunk {c}")
        idx = c * num_mbs + mb
        try:
            mine, dts, code = self.kinds[kind]
            dt = dts[c]
        except KeyError:
            self.error(f"rank {r}: unknown action kind {kind!r}")
            return t
        if self.durations is not None:
            dt = self.durations.get((kind, c, mb), dt)
        if mine[idx] is not None:
            self.error(f"rank {r}: {op} runs twice")
        if self.sharded:
            ready = self.resident[r].get(c)
            if ready is None:
                self.error(f"rank {r}: {op} computes without chunk {c}'s weights (no GATHER, or after RELEASE)")
            elif ready > t:
                t = ready
        if code == _F:
            p = self.prv[c]
            if p is not None:
                if self.f_end[p * num_mbs + mb] is None:
                    self.error(f"rank {r}: {op} runs before the forward of chunk {p}")
                elif chunk_rank[p] != r and not self.got_act[idx]:
                    self.error(f"rank {r}: {op} runs without receiving its activation")
            live = self.live
            live[r] += self.act[c]
            if live[r] > self.peak[r]:
                self.peak[r] = live[r]
        elif code == _B or code == _I:
            if self.f_end[idx] is None:
                self.error(f"rank {r}: {op} runs before its forward")
            n = self.nxt[c]
            if n is not None:
                nidx = n * num_mbs + mb
                if self.b_end[nidx] is None and self.i_end[nidx] is None:
                    self.error(f"rank {r}: {op} runs before the backward of chunk {n}")
                elif chunk_rank[n] != r and not self.got_grad[idx]:
                    self.error(f"rank {r}: {op} runs without receiving its gradient")
            if code == _B:
                self.live[r] -= self.act[c]
        elif code == _W:
            if self.i_end[idx] is None:
                self.error(f"rank {r}: {op} runs before its input-grad")
            self.live[r] -= self.act[c]
        else:   # STAGE_STEP: one chunk's optimizer step, after a SYNC_WAIT of its stage
            if self.b_end[idx] is None and self.w_end[idx] is None:
                self.error(f"rank {r}: {op} steps before micro-batch {mb}'s gradient exists")
            stage = self.chunk_stage[c]
            for key in self.own_syncs[r]:
                if key[0] == stage:
                    self.error(f"rank {r}: {op} steps while the gradient sync of stage {stage} is "
                               f"still pending (no SYNC_WAIT before it)")
                    break
        t += self.costs.dispatch
        self.records.append((r, kind, c, mb, t, t + dt))
        t += dt
        self.busy[r] += dt
        mine[idx] = t
        return t

    # ---- communication --------------------------------------------------------------------------
    def _comm(self, r, i, op, t):
        """Sends posted (once, even if the rank then waits), then receives awaited."""
        chunk_rank = self.chunk_rank
        num_mbs = self.num_mbs
        messages = self.messages
        if self.sends_posted[r] != i:
            self.sends_posted[r] = i
            costs = self.costs
            for m in op.sends:
                mkind, src, dst, mb = m
                if chunk_rank[src] != r:
                    self.error(f"rank {r}: sends {m} but chunk {src} lives on rank {chunk_rank[src]}")
                sidx = src * num_mbs + mb
                ready = self.f_end[sidx] is not None if mkind == "act" else \
                    (self.b_end[sidx] is not None or self.i_end[sidx] is not None)
                if not ready:
                    self.error(f"rank {r}: sends {m} before computing it")
                if m in messages:
                    self.error(f"rank {r}: sends {m} twice")
                t += costs.send
                messages[m] = t + costs.comm
                self.edge_sent[(mkind, src, dst)].append(mb)
                waiter = self.msg_waiter.pop(m, None)
                if waiter is not None:
                    self.wake(waiter)
        recvs = op.recvs
        for m in recvs:
            if m not in messages:
                self.msg_waiter[m] = r
                self.clock[r] = t
                return None
        recv = self.costs.recv
        for m in recvs:
            kind, src, dst, mb = m
            if chunk_rank[dst] != r:
                self.error(f"rank {r}: receives {m} but chunk {dst} lives on rank {chunk_rank[dst]}")
            self.edge_recv[(kind, src, dst)].append(mb)
            flags = self.got_act if kind == "act" else self.got_grad
            ridx = dst * num_mbs + mb
            if flags[ridx]:
                self.error(f"rank {r}: receives {m} twice")
            flags[ridx] = 1
            arrival = messages[m]
            if arrival > t:
                t = arrival
            t += recv
        return t

    # ---- the step's end: syncs, clipping, the optimizer ----------------------------------------
    def sync_done_time(self, key):
        posts = self.sync_posts[key]
        if len(posts) < len(self.sync_groups[key]):
            return None
        return max(posts.values()) + (self.costs.allreduce if len(posts) * self.data_parallel > 1 else 0.0)

    def _grad_sync(self, r, i, op, t):
        # a synchronous program syncs a stage once, after all its backwards; an asynchronous
        # one syncs before every step, which checks its own micro-batch's backward
        num_mbs, b_end, w_end = self.num_mbs, self.b_end, self.w_end
        for c in self.stage_chunks_on[r].get(op.stage, ()) if self.program.synchronous else ():
            for mb in self.routed[c]:
                idx = c * num_mbs + mb
                if b_end[idx] is None and w_end[idx] is None:
                    self.error(f"rank {r}: posts the gradient sync of stage {op.stage} before the backward "
                               f"of micro-batch {mb} on chunk {c}")
                    break
        t += self.costs.sync_post          # the all-reduce is under way once its post returns
        times = self.posted[r].setdefault(op.stage, [])
        skey = (op.stage, len(times))
        times.append(t)
        group = tuple(op.ranks)
        self.group_orders.setdefault((group, r), []).append(op.stage)
        if r not in group:
            self.error(f"rank {r}: posts the sync of stage {op.stage} for group {group} it is not in")
        known = self.sync_groups.setdefault(skey, group)
        if known != group:
            self.error(f"rank {r}: sync of stage {op.stage} over {group}, others use {known}")
        self.sync_posts.setdefault(skey, {})[r] = t
        self.own_syncs[r].append(skey)
        if self.sync_done_time(skey) is not None:
            for waiter in self.sync_waiters.pop(skey, ()):
                self.wake(waiter)
        return t

    def _sync_wait(self, r, i, op, t):
        finish = t
        waited = [key for key in self.own_syncs[r] if key[0] in op.stages]
        for skey in waited:
            when = self.sync_done_time(skey)
            if when is None:
                self.sync_waiters.setdefault(skey, []).append(r)
                self.clock[r] = t
                return None
            finish = max(finish, when)
        for skey in waited:
            self.sync_records.append((r, skey[0], self.sync_posts[skey][r], self.sync_done_time(skey)))
        self.own_syncs[r] = [key for key in self.own_syncs[r] if key[0] not in op.stages]
        return finish

    def _clip(self, r, i, op, t):
        if op.scope == ClipScope.GLOBAL:
            # a collective of every rank: the squared norms are summed over the pipeline
            num_ranks = self.num_ranks
            if self.clip_posted[r] != i:         # first visit: this rank arrives
                self.clip_posted[r] = i
                self.clip_round[r] += 1
                arrived = self.clip_arrivals.setdefault(self.clip_round[r], {})
                arrived[r] = t
                if len(arrived) == num_ranks:
                    for other in range(num_ranks):
                        self.wake(other)
            arrived = self.clip_arrivals[self.clip_round[r]]
            if len(arrived) < num_ranks:
                self.clock[r] = t
                return None
            t = max(t, max(arrived.values()) + self.costs.clip)
        elif op.stage not in self.stage_chunks_on[r]:
            self.error(f"rank {r}: clips stage {op.stage}, which it does not hold")
        return t

    def _step(self, r, i, op, t):
        for c in op.chunks:
            if not 0 <= c < self.nch or self.chunk_rank[c] != r:
                self.error(f"rank {r}: steps chunk {c}, which it does not hold")
        t += self.costs.step * self.size * len(op.chunks)
        self.stepped[r].update(op.chunks)
        if self.own_syncs[r]:
            self.error(f"rank {r}: steps the optimizer while the gradient syncs of stages "
                       f"{sorted({key[0] for key in self.own_syncs[r]})} are still pending (no SYNC_WAIT before it)")
        return t

    # ---- sharded data parallelism: a chunk's weights gathered where the program says --------------
    def _gather(self, r, i, op, t):
        resident = self.resident[r]
        if not 0 <= op.chunk < self.nch or self.chunk_rank[op.chunk] != r:
            self.error(f"rank {r}: gathers chunk {op.chunk}, which it does not hold")
        elif op.chunk in resident:
            self.error(f"rank {r}: gathers chunk {op.chunk} while its weights are already gathered")
        else:
            costs = self.costs
            t += costs.gather_post
            # posted: it overlaps what follows, and ends ``gather`` after the later peer's post
            resident[op.chunk] = t + costs.gather_skew + costs.gather * self.size
            self.gathers[r] += 1
            self.gathered_peak[r] = max(self.gathered_peak[r], len(resident) * self.size)
        return t

    def _release(self, r, i, op, t):
        if self.resident[r].pop(op.chunk, None) is None:
            self.error(f"rank {r}: releases chunk {op.chunk}, whose weights are not gathered")
        return t

    def _unknown(self, r, i, op, t):
        self.error(f"rank {r}: unknown op {op!r}")
        return t


def _describe_wait(program, rank, index, messages, sync_posts, sync_groups) -> str:
    op = program.ops[rank][index]
    placement = program.placement
    if type(op) is Comm:
        missing = [m for m in op.recvs if m not in messages]
        return "; ".join(f"waits for {m.kind} of micro-batch {m.mb} from chunk {m.src} "
                         f"on rank {placement.rank_of(m.src)}" for m in missing) or "waits in a comm batch"
    if type(op) is Clip:
        return f"op {index} ({op}) waits for every rank to reach its global clip"
    if type(op) in (SyncWait, Action):
        waits = [f"stage {stage} sync from ranks {sorted(set(sync_groups[(stage, n)]) - set(posts))}"
                 for (stage, n), posts in sync_posts.items()
                 if rank in posts and len(posts) < len(sync_groups[(stage, n)])]
        return f"op {index} ({op}) waits for " + ("; ".join(waits) or "gradient syncs")
    return f"stuck at op {index}: {op!r}"


def _check_complete(sim: _Simulation) -> None:
    """The checks of a program that ran to its end: every micro-batch's work, message order, steps, syncs."""
    placement, num_mbs, error = sim.placement, sim.num_mbs, sim.error
    f_end, b_end, i_end, w_end = sim.f_end, sim.b_end, sim.i_end, sim.w_end
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
    for edge, order in sim.edge_sent.items():
        if sim.edge_recv.get(edge, []) != order:
            error(f"messages {edge[0]} {edge[1]}->{edge[2]} are received in another order than sent "
                  f"({sim.edge_recv.get(edge, [])[:6]} vs {order[:6]}); NCCL would pair them wrongly")
    if sim.program.synchronous:
        for r in range(sim.num_ranks):
            never = sorted(set(placement.chunks_on(r)) - sim.stepped[r])
            if never:
                error(f"rank {r} never steps the optimizer on chunks {never} (a synchronous program ends "
                      f"with SYNC_WAIT, CLIP and STEP)")
            for stage in sim.stage_chunks_on[r]:
                if len(placement.stage_group(stage)) > 1 and not sim.posted[r].get(stage):
                    error(f"rank {r} never posts the gradient sync of replicated stage {stage}")
    for (group, r), stages in sim.group_orders.items():
        for other in group:
            if sim.group_orders.get((group, other), []) != stages:
                error(f"ranks {r} and {other} post the syncs of group {group} in different orders")
                break
