"""The schedule contract: a pure function of (stages, micro-batches, options) to data.

A schedule validates its options when constructed, then exposes a :class:`Placement`
and one ordered list of compute :class:`Action` per rank. It never touches
``torch.distributed``; :meth:`Schedule.lower` hands the result to every consumer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from ..validation import check_int
from .actions import split_chunks
from .lowering import Program, lower
from .placement import Placement


class Schedule:
    """Base class. Subclasses set ``name``, ``summary``, ``options`` and build the data.

    Built from ``stages`` in DeepSpeed's sense (a PipelineModule's ``num_stages``: the pipeline's ranks),
    kept as ``self.ranks`` (D); the model stages the schedule cuts are its placement's
    (``placement.num_stages``: D for 1F1B, 2D for the V schedules, V*D for looped ones)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[dict] = {}         # option -> default
    synchronous: ClassVar[bool] = True   # False: no flush, the schedule emits its own steps

    def __init__(self, stages: int, micro_batches: int, **options):
        self._configure(stages, micro_batches, options)
        self.orders: list = self.build_orders()

    @classmethod
    def placed(cls, stages: int, micro_batches: int, **options) -> "Schedule":
        """The schedule with its options checked and its placement built but no orders: what the
        planner's bounds need, without the cost of ordering (list-scheduled orders take seconds at scale)."""
        schedule = cls.__new__(cls)
        schedule._configure(stages, micro_batches, options)
        return schedule

    def _configure(self, stages: int, micro_batches: int, options: dict) -> None:
        self.ranks = check_int(self.name, "stages", stages, 1)      # pipeline ranks D (DeepSpeed's num_stages)
        self.micro_batches = check_int(self.name, "micro_batches", micro_batches, 1)
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            allowed = ", ".join(sorted(self.options)) or "none"
            raise ValueError(f"{self.name}: unknown option {unknown[0]!r}; allowed options: {allowed}")
        self.config = {**self.options, **options}
        self.validate()
        self.resolve()
        self.placement = self.build_placement()

    @property
    def chunks_per_rank(self) -> int:
        return len(self.placement.chunks_on(0))

    @property
    def splits_backward(self) -> bool:
        """Whether some rank's order runs a chunk's input- and weight-gradient passes apart, read from the orders
        (built here for a schedule that :meth:`placed` made without them)."""
        orders = self.__dict__.get("orders")
        if orders is None:
            orders = self.build_orders()
        return any(split_chunks(order) for order in orders)

    def validate(self) -> None:
        """Raise ValueError for options that cannot work with these stages and micro-batches (checks only)."""

    def resolve(self) -> None:
        """Settle what the options leave to the schedule (Chimera's ``order="auto"`` searches its orders);
        runs after :meth:`validate`, before the placement is built."""

    def build_placement(self) -> Placement:
        raise NotImplementedError

    def build_orders(self) -> list:
        raise NotImplementedError

    def lower(self) -> Program:
        program = lower(self.name, self.placement, self.orders, self.synchronous)
        program.weights = self.weights_per_rank()
        return program

    def weights_per_rank(self) -> list:
        """Weight copies per rank in stage units; asynchronous schedules add stashed versions."""
        return self.placement.weights_per_rank()

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{type(self).__name__}(stages={self.ranks}, micro_batches={self.micro_batches}{', ' if opts else ''}{opts})"


class AsynchronousSchedule(Schedule, ABC):
    """The contract of a schedule that steps each stage inside the pipeline (no flush): every method and
    attribute the asynchronous engine (runtime/async_engine.py) and the weight versions (optim/versions.py)
    read. Orders hold ``S`` actions (one stage's optimizer step) after the backwards that complete an update."""

    synchronous: ClassVar[bool] = False
    weight_policy: ClassVar[str] = "stash"     # "stash": the backward sees its forward's version; "predict": the
    #                                            forward sees weights predicted steps_ahead() updates ahead

    @abstractmethod
    def update_interval(self) -> int:
        """Backwards (micro-batches) per optimizer update; the engine divides each loss by it."""

    @property
    @abstractmethod
    def continuous(self) -> bool:
        """Whether the pipeline stays full across train_batch calls (the engine then runs :meth:`part_program`)."""

    @abstractmethod
    def versions(self) -> dict:
        """(chunk, mb) -> (updates applied before its forward, updates applied before its backward)."""

    @abstractmethod
    def steps_ahead(self, chunk: int, mb: int) -> int:
        """How many updates ahead the forward of (chunk, mb) predicts the weights (``predict`` policy)."""

    @abstractmethod
    def part_program(self, part: str) -> Program:
        """The lowered program of one call of a continuous pipeline: ``part`` is first, steady or drain."""

    @abstractmethod
    def unrolled_program(self, calls: int) -> Program:
        """first + steady x (calls - 1) + drain as one program: what the simulator proves for continuous fill."""

    @abstractmethod
    def part_steps_ahead(self) -> dict:
        """part -> {(chunk, call-local mb): steps ahead}, for the predictor of a continuous pipeline."""

    @abstractmethod
    def weights_per_rank(self) -> list:
        """Peak weight versions per rank (stashed or predicted copies included): the memory model reads it."""


def linear_placement(stages: int, micro_batches: int) -> Placement:
    """One replica, stage i on rank i."""
    return Placement(stages, stages, [list(range(stages))], [0] * micro_batches)


def looped_placement(ranks: int, chunks: int, micro_batches: int) -> Placement:
    """One replica of ranks*chunks stages, stage s on rank s mod ranks (interleaved, BFS)."""
    return Placement(ranks, ranks * chunks, [[s % ranks for s in range(ranks * chunks)]],
                     [0] * micro_batches)


def vshape_placement(ranks: int, micro_batches: int) -> Placement:
    """One replica of 2*ranks stages: down the ranks and back up (ZB-V, DualPipeV)."""
    stages = list(range(ranks)) + list(range(ranks - 1, -1, -1))
    return Placement(ranks, 2 * ranks, [stages], [0] * micro_batches)
