"""Asynchronous 1F1B: PipeOptim and the PipeDream family, as data.

Every stage steps its own optimizer right after a mini-batch's backward (the ``S`` action),
so there is no flush between updates. The schedules differ only in which weight version a
mini-batch's forward and backward see, which :attr:`weight_policy` names and
``ds_chimera.optim.versions`` implements:

- ``stash``   (PipeDream, 2BW): the forward uses the live weights, the backward the same version.
- ``predict`` (PipeOptim, SpecTrain): the forward uses weights predicted ``s`` updates ahead,
  the backward the live weights.

One ``train_batch`` runs N mini-batches through a full pipeline and drains it at the end
(see the runtime docs for why). Version numbers below count the updates a stage has applied
since the start of that call.
"""
from __future__ import annotations

from ..validation import check_int
from .actions import BACKWARD, FORWARD, STAGE_STEP, Action
from .base import AsynchronousSchedule, linear_placement
from .classic import one_f_one_b_orders
from .lowering import lower

STEPS_AHEAD = ("paper", "code")
FILL = ("call", "continuous")
PARTS = ("first", "steady", "drain")


def check_steps_ahead(schedule: str, value):
    if value in STEPS_AHEAD or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"{schedule}: steps_ahead must be 'paper' (s = D-1-k), 'code' (s = D-k) or an integer >= 0; "
                     f"got {value!r}")


class AsyncOneFOneB(AsynchronousSchedule):
    """Base: the 1F1B order, plus one optimizer step per ``update_interval`` backwards."""

    def update_interval(self) -> int:
        return 1

    def validate(self):
        interval = self.update_interval()
        if self.micro_batches % interval:
            raise ValueError(f"{self.name}: micro_batches ({self.micro_batches}) must be a multiple of the update "
                             f"interval ({interval}), so that every train_batch ends on a complete update")
        fill = self.config.get("fill", "call")
        if fill not in FILL:
            raise ValueError(f"{self.name}: fill must be 'call' (fill and drain the pipeline in every train_batch) "
                             f"or 'continuous' (keep it full across calls); got {fill!r}")

    @property
    def continuous(self) -> bool:
        return self.config.get("fill", "call") == "continuous"

    def build_placement(self):
        return linear_placement(self.ranks, self.micro_batches)

    def build_orders(self):
        interval = self.update_interval()
        orders = []
        for order in one_f_one_b_orders(self.placement, 0, list(range(self.micro_batches))):
            out = []
            for action in order:
                out.append(action)
                if action.kind == BACKWARD and (action.mb + 1) % interval == 0:
                    out.append(Action(STAGE_STEP, action.chunk, action.mb))
            orders.append(out)
        return orders

    # ---- a pipeline that stays full across calls (fill = continuous) ---------------------------
    def part_orders(self, part: str) -> list:
        """Per-rank orders of one call when the pipeline stays full, in call-local micro-batch ids.

        Rank k runs D-1-k = w forwards ahead of its backwards. ``steady``: F(w+j), B(j), S(j) for
        j < N; ids from N on belong to the next call, where they are j - N. ``first`` adds the
        warm-up F(0..w-1); ``drain`` finishes the D-1 mini-batches still in flight (the last rank
        reads their labels then).
        """
        if part not in PARTS:
            raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
        n, depth, interval = self.micro_batches, self.ranks, self.update_interval()
        count = depth - 1 if part == "drain" else n
        orders = []
        for k in range(depth):
            warm, out = depth - 1 - k, []
            if part == "first":
                out += [Action(FORWARD, k, mb) for mb in range(warm)]
            for j in range(count):
                if part != "drain" or warm + j < depth - 1:
                    out.append(Action(FORWARD, k, warm + j))
                out.append(Action(BACKWARD, k, j))
                if (j + 1) % interval == 0 or (part == "drain" and j == count - 1):
                    out.append(Action(STAGE_STEP, k, j))
            orders.append(out)
        return orders

    def unrolled_orders(self, calls: int) -> list:
        """first + (calls - 1) x steady + drain, in global ids: what the simulator proves."""
        n, parts = self.micro_batches, ["first"] + ["steady"] * (calls - 1) + ["drain"]
        orders = [[] for _ in range(self.ranks)]
        for call, part in enumerate(parts):
            for rank, order in enumerate(self.part_orders(part)):
                orders[rank] += [Action(kind, chunk, mb + call * n) for kind, chunk, mb in order]
        return orders

    def part_program(self, part: str):
        """One call's lowered program (call-local micro-batch ids, D-1 of them beyond N)."""
        placement = linear_placement(self.ranks, self.micro_batches + self.ranks - 1)
        return lower(f"{self.name}-{part}", placement, self.part_orders(part), synchronous=False)

    def unrolled_program(self, calls: int):
        """The lowered first + steady... + drain run over calls * N + D - 1 mini-batches, for the simulator."""
        placement = linear_placement(self.ranks, calls * self.micro_batches + self.ranks - 1)
        return lower(self.name, placement, self.unrolled_orders(calls), synchronous=False)

    def part_steps_ahead(self) -> dict:
        """part -> {(chunk, call-local mb): steps ahead}, read off the unrolled orders."""
        n = self.micro_batches
        gaps = _distances(self.unrolled_orders(3))
        call_of = {"first": 0, "steady": 1, "drain": 3}
        out = {}
        for part in PARTS:
            base = call_of[part] * n
            out[part] = {(c, mb - base): self._ahead(gap) for (c, mb), gap in gaps.items() if mb >= base}
        return out

    def _ahead(self, gap: int) -> int:
        return gap

    # ---- weight versions -----------------------------------------------------------------
    def versions(self) -> dict:
        """(chunk, mb) -> (updates applied before its forward, updates applied before its backward)."""
        if getattr(self, "_versions", None) is None:
            self._versions = self._count_versions()
        return self._versions

    def _count_versions(self) -> dict:
        return _count_versions(self.orders)

    def steps_ahead(self, chunk: int, mb: int) -> int:
        """How many updates ahead a forward's predicted weights look (``predict`` policy only)."""
        fwd, bwd = self.versions()[(chunk, mb)]
        return bwd - fwd

    def weights_per_rank(self) -> list:
        """Peak weight versions a rank holds, counted by replaying its order.

        ``stash``: the live version plus every older version an in-flight mini-batch still
        needs. ``predict``: the live weights plus one predicted copy while a forward runs,
        whenever that forward looks at least one update ahead.
        """
        peaks = []
        for rank, order in enumerate(self.orders):
            steps, inflight, peak = 0, {}, 1
            for kind, chunk, mb in order:
                if kind == FORWARD:
                    inflight[mb] = steps
                    if self.weight_policy == "predict" and self.steps_ahead(chunk, mb) > 0:
                        peak = max(peak, 2)
                elif kind == BACKWARD:
                    del inflight[mb]
                elif kind == STAGE_STEP:
                    steps += 1
                if self.weight_policy == "stash":
                    peak = max(peak, len(set(inflight.values()) | {steps}))
            peaks.append(peak)
        return peaks


class PipeDream(AsyncOneFOneB):
    """PipeDream (Narayanan et al., SOSP 2019): weight stashing, D-k versions at stage k.

    The backward of a mini-batch uses the version its forward used; stages see different
    versions of one mini-batch (no vertical sync), so updates are D-1-k steps stale at stage k.
    """

    name = "pipedream"
    summary = "async 1F1B with weight stashing; D-k weight versions at stage k"
    options = {"fill": "call"}


class PipeDream2BW(AsyncOneFOneB):
    """PipeDream-2BW (Narayanan et al., ICML 2021): double-buffered weights, delay 1.

    Gradients accumulate over ``update_interval`` micro-batches (default D, the smallest
    that keeps two versions); every new micro-batch's forward uses the newest version and
    its backward the same one, so W(t+1) = W(t) - lr * grad(W(t-1)).
    """

    name = "pipedream-2bw"
    summary = "async 1F1B, double-buffered weights: update every update_interval micro-batches, delay 1"
    options = {"update_interval": None, "fill": "call"}

    def update_interval(self) -> int:
        value = self.config["update_interval"]
        return self.ranks if value is None else value

    def validate(self):
        if self.config["update_interval"] is not None:
            check_int(self.name, "update_interval", self.config["update_interval"], 1)
        super().validate()
        if self.continuous:
            raise ValueError(f"{self.name}: fill='continuous' is not supported: its drain would end on a partial "
                             f"update of {self.ranks - 1} micro-batches; use fill='call'")


class PipeOptim(AsyncOneFOneB):
    """PipeOptim (Guan et al., arXiv 2312.00839): optimizer-dependent weight prediction.

    The forward at stage k uses W - lr * s * Delta, Delta being the optimizer's own last
    update direction and s = D-1-k in steady state; the backward uses the live weights.
    """

    name = "pipeoptim"
    summary = "async 1F1B, forward on weights predicted by the optimizer's update rule; 2 versions"
    options = {"predictor": "auto", "steps_ahead": "paper", "fill": "call"}
    weight_policy = "predict"

    def validate(self):
        if not isinstance(self.config["predictor"], str):
            raise ValueError(f"{self.name}: predictor must be 'auto' or a predictor name, "
                             f"got {self.config['predictor']!r}")
        check_steps_ahead(self.name, self.config["steps_ahead"])
        super().validate()

    def steps_ahead(self, chunk: int, mb: int) -> int:
        """``paper``: s = D-1-k, the distance to the backward (smaller in the warm-up after a
        flush, where the backward really is fewer updates away); ``code``: one more, as the
        published code; an integer: that many."""
        return self._ahead(super().steps_ahead(chunk, mb))

    def _ahead(self, gap: int) -> int:
        choice = self.config["steps_ahead"]
        if choice == "paper":
            return gap
        if choice == "code":
            return gap + 1
        return choice


class SpecTrain(PipeOptim):
    """SpecTrain (Chen et al., arXiv 1809.02839): prediction from the smoothed gradient.

    Like PipeOptim, but Delta is an exponential moving average of the gradients
    (``smoothing``) whatever the optimizer, which is what PipeOptim improves on.
    """

    name = "spectrain"
    summary = "async 1F1B, forward on weights predicted from the smoothed gradient; 2 versions"
    options = {"steps_ahead": "paper", "smoothing": 0.9, "fill": "call"}

    def validate(self):
        smoothing = self.config["smoothing"]
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing < 1:
            raise ValueError(f"{self.name}: smoothing must be a number in [0, 1), got {smoothing!r}")
        check_steps_ahead(self.name, self.config["steps_ahead"])
        AsyncOneFOneB.validate(self)


def _count_versions(orders: list) -> dict:
    """(chunk, mb) -> (steps applied before its forward, steps applied before its backward)."""
    seen = {}
    for order in orders:
        steps, fwd = 0, {}
        for kind, chunk, mb in order:
            if kind == FORWARD:
                fwd[mb] = steps
            elif kind == BACKWARD:
                seen[(chunk, mb)] = (fwd.pop(mb), steps)
            elif kind == STAGE_STEP:
                steps += 1
    return seen


def _distances(orders: list) -> dict:
    return {key: bwd - fwd for key, (fwd, bwd) in _count_versions(orders).items()}
