"""Chimera: bidirectional pipelines (Li & Hoefler, SC 2021, arXiv:2107.06925)."""
from __future__ import annotations

from ..sim.simulator import simulate
from ..validation import check_choice, check_int, check_mapping
from .actions import BACKWARD, FORWARD, Action, activation_peaks
from .base import Schedule, linear_placement
from .classic import one_f_one_b_orders
from .costs import COST_NAMES, Costs
from .lowering import lower
from .placement import Placement
from .timing import fastest_list_schedule, merge_by_time

ORDERS = ("auto", "concat", "forward-doubling", "merged", "zero-bubble")
AUTO_CANDIDATES = ("concat", "forward-doubling", "merged", "zero-bubble")   # ``auto``'s choices; ties: earlier


class Chimera(Schedule):
    """Chimera: f down and f up 1F1B pipelines merged on the same D ranks.

    Down pipeline k puts stage i on rank (i + kD/f) mod D, up pipeline k on rank
    (D-1-i + kD/f) mod D, so every rank holds 2f stages (2f x weights) and each stage's
    replicas all-reduce their gradients. At N = D the bubble is (D-2)/(2N+D-2).

    ``order`` says how N > D micro-batches are laid out:

    * ``concat``: the paper's direct concatenation of basic units of D micro-batches,
      each unit placed one unit of work after the previous, so a unit's first forwards
      fill the previous unit's trailing bubbles;
    * ``forward-doubling``: units of 2D micro-batches where each slot carries a pair of
      micro-batches (the paper's remedy when backward costs more than forward; it holds
      twice the activations, which the paper offsets with recomputation);
    * ``merged``: two whole 1F1B pipelines of N/2 micro-batches merged on unit-slot times
      (D+1 activations at most instead of D, and no unit junctions);
    * ``zero-bubble``: the backward split into I and W (Qi et al., arXiv:2401.10241) and
      the bidirectional placement list-scheduled like ZB-V, with 1F1B's peak of D
      micro-batches in flight per rank. A rank starts once the nearest pipeline's first
      forwards reach it, so at F = I = W and N >= 2D the makespan is 3N + (D-1)//2 units
      with f = 1 (ZB-V: 3N + (D-1)/2; 1F1B: 3N + 3(D-1)), and 3N with f = D/2, where
      every rank heads a pipeline (at D stage copies of weights per rank);
    * ``auto``: simulate the four orders under ``costs`` (default F=1, B=2, W=1) and keep
      the fastest of those whose peak activations per rank stay within ``max_activations``
      micro-batches (default: 1F1B's peak, min(N, D)), so switching from 1F1B to Chimera
      never needs more activation memory. ``concat`` always fits; ``forward-doubling``
      (2D) and ``merged`` (D+1) fit only with a larger budget. With ``recompute`` (set by the
      runtime under activation checkpointing) the backward recomputes the forward first, once
      for a fused backward and twice for a split one (I and W each), which ``auto`` prices.

    Unlike the reference generator, no order ever drops an operation, for any N >= 1.
    """

    name = "chimera"
    summary = "bidirectional pipelines, 2f replicas per rank; bubble (D-2)/(2N+D-2) at N=D"
    options = {"pipelines": 1, "order": "auto", "costs": None, "max_activations": None, "recompute": False}

    def validate(self):
        d = self.ranks
        if d == 1:
            self._validate_one_stage()
            return
        if d % 2:
            raise ValueError(f"chimera needs an even number of stages, got {d}")
        self.pipelines = check_int(self.name, "pipelines", self.config["pipelines"], 1)
        if (d // 2) % self.pipelines:
            divisors = [k for k in range(1, d // 2 + 1) if (d // 2) % k == 0]
            raise ValueError(f"chimera: pipelines must divide stages/2 = {d // 2} (allowed: {divisors}), "
                             f"got {self.pipelines}")
        routes = 2 * self.pipelines
        if self.micro_batches < routes:
            raise ValueError(f"chimera with pipelines={self.pipelines} runs {routes} pipelines, each with its own "
                             f"replica of the model, and needs micro_batches (DeepSpeed's "
                             f"gradient_accumulation_steps, Megatron's num_microbatches) >= {routes}, got {self.micro_batches}: with fewer, a "
                             f"replica's layers would hold weights but never train; use more micro-batches or 1f1b")
        self.order = check_choice(self.name, "order", self.config["order"], ORDERS)
        limit = self.config["max_activations"]
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 1:
                raise ValueError(f"chimera: max_activations must be a number of micro-batches >= 1 (the "
                                 f"activations a rank may hold at once), got {limit!r}")
            if self.order != "auto":
                raise ValueError(f"chimera: max_activations bounds the choice of order: auto, and order "
                                 f"{self.order!r} is named; drop one of them")
        if not isinstance(self.config["recompute"], bool):
            raise ValueError(f"chimera: recompute must be true or false, got {self.config['recompute']!r}")

    def resolve(self) -> None:
        """``order="auto"``: the order search (:meth:`_choose`); ``self.order`` becomes the chosen one, and
        ``auto_candidate`` holds the candidate schedule it priced, whose placement and orders are reused."""
        self.auto_candidate = None
        if self.ranks > 1 and self.order == "auto":
            self.order, self.auto_candidate = self._choose(
                self.ranks, self.micro_batches, self.pipelines, self.config["costs"],
                self.config["max_activations"], self.config["recompute"])

    def _validate_one_stage(self) -> None:
        """One stage (a 1-stage PipelineModule: pure data parallelism). Both pipelines' replicas would be
        the same whole model on the same rank doing the same work on halves of the micro-batches and then
        summing their gradients: one copy running every micro-batch computes exactly that, with half the
        weights. So Chimera on one stage is that copy's forward-backward per micro-batch, which is also
        what DeepSpeed's stock engine runs there."""
        self.pipelines = check_int(self.name, "pipelines", self.config["pipelines"], 1)
        if self.pipelines != 1:
            raise ValueError(f"chimera on 1 stage has one replica per data-parallel rank (pipelines must be 1), "
                             f"got pipelines={self.pipelines}")
        self.order = check_choice(self.name, "order", self.config["order"], ORDERS)
        if not isinstance(self.config["recompute"], bool):
            raise ValueError(f"chimera: recompute must be true or false, got {self.config['recompute']!r}")

    @staticmethod
    def _choose(stages: int, micro_batches: int, pipelines: int, costs=None, max_activations=None,
                recompute: bool = False) -> tuple:
        """The fastest order under ``costs`` whose peak activations fit ``max_activations`` (ties: earlier).

        The makespan is the simulator's on the candidate's lowered program: the one timing model of the package.
        ``max_activations`` defaults to 1F1B's peak on the same ranks, min(N, D) micro-batches;
        ``concat`` never exceeds it, so some order always fits.
        """
        if costs is None:
            costs = Costs()
        elif not isinstance(costs, Costs):
            costs = Costs(**check_mapping("chimera", "costs", costs, COST_NAMES, '{"fwd": 1, "bwd": 2}'))
        limit = min(micro_batches, stages) if max_activations is None else max_activations
        best = None
        for order in AUTO_CANDIDATES:
            candidate = Chimera(stages, micro_batches, pipelines=pipelines, order=order)
            if order != "concat" and peak_activations(candidate.orders) > limit:
                continue
            priced = _with_recomputation(costs, split=order == "zero-bubble") if recompute else costs
            makespan = simulate(lower("chimera", candidate.placement, candidate.orders), priced).makespan
            if best is None or makespan < best[0] - 1e-9:
                best = (makespan, order, candidate)
        return best[1], best[2]         # the chosen candidate's placement and orders are reused, not rebuilt

    # -- placement -----------------------------------------------------------------
    def stage_ranks(self) -> list:
        d, f = self.ranks, self.pipelines
        shift = d // f
        down = [[(i + k * shift) % d for i in range(d)] for k in range(f)]
        up = [[(d - 1 - i + k * shift) % d for i in range(d)] for k in range(f)]
        return down + up

    def slots(self) -> list:
        """Micro-batches that travel together: pairs under forward doubling, else singles."""
        n = self.micro_batches
        width = 2 if self.order == "forward-doubling" else 1
        return [list(range(s, min(s + width, n))) for s in range(0, n, width)]

    def slot_pipelines(self) -> list:
        """The pipeline (replica) of each slot."""
        num_slots, p, d = len(self.slots()), 2 * self.pipelines, self.ranks
        if self.order == "merged":
            return [s % p for s in range(num_slots)]
        out = []
        for start in range(0, num_slots, d):          # one basic unit of D slots at a time
            unit = min(d, num_slots - start)
            out.extend(_split_evenly(unit, p))
        return out

    def build_placement(self):
        if self.ranks == 1:
            return linear_placement(1, self.micro_batches)
        if self.auto_candidate is not None:
            return self.auto_candidate.placement
        mb_replica = [0] * self.micro_batches
        for slot, pipe in zip(self.slots(), self.slot_pipelines()):
            for mb in slot:
                mb_replica[mb] = pipe
        return Placement(self.ranks, self.ranks, self.stage_ranks(), mb_replica)

    # -- order -----------------------------------------------------------------
    def build_orders(self):
        if self.ranks == 1:
            return one_f_one_b_orders(self.placement, 0, list(range(self.micro_batches)))
        if self.auto_candidate is not None:
            candidate, self.auto_candidate = self.auto_candidate, None     # used once: not kept with the schedule
            return candidate.orders
        d, pipes = self.ranks, 2 * self.pipelines
        if self.order == "zero-bubble":
            return fastest_list_schedule(self.placement, [float(d)] * d, f"{self.name} order=zero-bubble",
                                         late_chunk_first=(True, False))
        slots, slot_pipe = self.slots(), self.slot_pipelines()
        if self.order == "merged":
            units = [list(range(len(slots)))]
        else:
            units = [list(range(s, min(s + d, len(slots)))) for s in range(0, len(slots), d)]
        period = 2 * d   # one unit's work per rank, in unit slots (F = B = 1)
        timed = []
        pieces: dict = {}
        for u, unit in enumerate(units):
            for p in range(pipes):
                members = [s for s in unit if slot_pipe[s] == p]
                if not members:
                    continue
                key = (p, len(members))
                if key not in pieces:
                    pieces[key] = self._piece(p, len(members))
                for time, kind, stage, local, rank in pieces[key]:
                    chunk = self.placement.routes[p][stage]
                    tie = (u, 0 if kind == BACKWARD else 1, p)
                    for mb in slots[members[local]]:
                        timed.append((time + u * period, tie, rank, Action(kind, chunk, mb)))
        return merge_by_time(d, timed)

    def _piece(self, pipe: int, n: int) -> list:
        """Unit-slot timing of one 1F1B pipeline of ``n`` slots on ``pipe``'s ranks.

        ``merged`` times each pipeline as an eager 1F1B on its own. Basic units use the
        steady-state cadence instead: stage s runs forward k at s + 2k and backward k at
        2D-1-s+2k. The down and up pipelines then never claim the same slot (forwards of
        one and backwards of the other differ in parity or by D/2 micro-batches), which is
        why Chimera's merge is conflict-free for even D.
        """
        d = self.ranks
        ranks = self.stage_ranks()[pipe]
        if self.order != "merged":
            return [(t, kind, s, k, ranks[s]) for s in range(d) for k in range(n)
                    for kind, t in ((FORWARD, s + 2 * k), (BACKWARD, 2 * d - 1 - s + 2 * k))]
        local = Placement(d, d, [ranks], [0] * n)
        orders = one_f_one_b_orders(local, 0, list(range(n)))
        timed = simulate(lower("1f1b", local, orders), Costs(fwd=1.0, bwd=1.0, wgrad=0.0)).records
        return [(start, kind, chunk, mb, ranks[chunk]) for _, kind, chunk, mb, start, _ in timed]


def _with_recomputation(costs: Costs, split: bool) -> Costs:
    """Costs under activation checkpointing: a fused backward recomputes the forward once; a split one
    recomputes it for the input-grad and again for the weight-grad."""
    from dataclasses import replace
    if split:
        return replace(costs, bwd=costs.bwd + 2 * costs.fwd, wgrad=costs.wgrad + costs.fwd)
    return replace(costs, bwd=costs.bwd + costs.fwd, wgrad=min(costs.wgrad + costs.fwd, costs.bwd + costs.fwd))


def peak_activations(orders: list) -> int:
    """The most micro-batches' activations any rank holds at once (see ``activation_peaks``)."""
    return max(activation_peaks(orders), default=0)


def _split_evenly(count: int, parts: int) -> list:
    """Contiguous split of ``count`` items into ``parts`` groups, earlier groups larger."""
    base, extra = divmod(count, parts)
    out = []
    for p in range(parts):
        out.extend([p] * (base + (1 if p < extra else 0)))
    return out
