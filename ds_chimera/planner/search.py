"""The planner: the fastest schedule, options and layer cut for a profiled model, within its memory.

Every candidate (schedule x options x cut) is priced by the simulator on the profile's measured
costs and kept only if each rank's memory (:mod:`.memory`) fits the budget. Candidates are
taken in order of a lower bound on their step time (the busiest rank's own compute), and one
whose bound cannot beat the best step found so far is not simulated: the choice is the same as
the exhaustive sweep's, found sooner. Memory is checked before timing (weights from the
placement, then activations along the orders), so what does not fit is never simulated.

Asynchronous schedules change the optimisation (stale or predicted weights); they are
candidates only when the user allows them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..logs import get_logger
from ..schedules import registry
from ..schedules.actions import activation_peaks
from ..schedules.chimera import AUTO_CANDIDATES as CHIMERA_ORDERS
from ..schedules.costs import Costs
from ..sim.simulator import simulate
from .cuts import CUT_METHODS, boundary_bytes, cut, stage_costs, stage_sums
from .memory import GIB, rank_memory, rank_params, state_bytes_per_param
from .profile import Profile

log = get_logger()

MAX_CHUNKS = 4          # chunks per rank tried for looped schedules (interleaved, breadth-first)


@dataclass(frozen=True)
class Budget:
    """What a rank may hold: bytes in all (None: no limit), and at most ``max_activations``
    micro-batches' activations (None: no limit), as the simulator counts them."""

    memory_bytes: float | None = None
    max_activations: float | None = None

    def describe(self) -> str:
        parts = []
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / GIB:.3g} GiB per rank")
        if self.max_activations is not None:
            parts.append(f"at most {self.max_activations:g} micro-batches of activations per rank")
        return " and ".join(parts) or "no memory limit"


@dataclass(frozen=True)
class Setting:
    """What the job fixes: its ranks, micro-batches, precision, ZeRO stage and checkpointing."""

    stages: int
    micro_batches: int
    data_parallel: int = 1
    precision: str = "fp32"
    zero: int = 0
    checkpoint_interval: int = 0
    allow_asynchronous: bool = False
    tensor_parallel: int = 1      # T: the profile is one tensor rank's (its shards, its messages), as each runs


@dataclass
class Candidate:
    schedule: str
    options: dict
    cut: str
    parts: list | None = None
    step_s: float | None = None          # the simulator's step time on the profile
    memory: list | None = None           # RankMemory per rank
    peak_micro_batches: float | None = None
    excluded: str | None = None          # why it cannot be chosen (None: it fits)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.schedule}{' ' + opts if opts else ''} cut={self.cut}"

    @property
    def peak_bytes(self) -> float | None:
        return max(m.total for m in self.memory) if self.memory else None


@dataclass
class PlanResult:
    chosen: Candidate | None
    candidates: list
    setting: Setting
    budget: Budget
    seconds: float = 0.0
    simulated: int = 0
    notes: list = field(default_factory=list)

    def pipeline_section(self) -> dict:
        """The ``"pipeline"`` section that runs the choice again: schedule, options and layer cut."""
        if self.chosen is None:
            raise ValueError(self.why_nothing())
        return {"schedule": self.chosen.schedule, **self.chosen.options, "parts": list(self.chosen.parts)}

    def why_nothing(self) -> str:
        reasons = sorted({c.excluded for c in self.candidates if c.excluded})[:3]
        return (f"no schedule fits the memory budget ({self.budget.describe()}) for D={self.setting.stages}, "
                f"N={self.setting.micro_batches}: " + "; ".join(reasons) +
                "; raise the budget (memory_limit_gb / max_activations), use ZeRO or activation checkpointing, "
                "or more pipeline stages")

    def report(self, runners_up: int = 8) -> str:
        s = self.setting
        tensor = f" T={s.tensor_parallel}" if s.tensor_parallel > 1 else ""
        lines = [f"planned D={s.stages} N={s.micro_batches} dp={s.data_parallel}{tensor} {s.precision} ZeRO-{s.zero}, "
                 f"budget: {self.budget.describe()}; {len(self.candidates)} candidates, {self.simulated} "
                 f"simulated, {self.seconds:.2f} s"]
        if self.chosen is None:
            lines.append("  nothing fits: " + self.why_nothing())
            return "\n".join(lines)
        best = self.chosen.step_s
        lines.append(f"  chosen: {self.chosen.label}: step {_fmt_s(best)}, peak memory "
                     f"{_fmt_bytes(self.chosen.peak_bytes)} per rank, parts {self.chosen.parts}")
        timed = sorted((c for c in self.candidates if c.step_s is not None), key=lambda c: c.step_s)
        shown = {(self.chosen.schedule, tuple(self.chosen.options.items()))}
        listed = 0
        for c in timed:        # the fastest cut of each other schedule and option set
            key = (c.schedule, tuple(c.options.items()))
            if key in shown or listed >= runners_up:
                continue
            shown.add(key)
            listed += 1
            why = c.excluded or f"{c.step_s / best:.3f}x the chosen step"
            lines.append(f"  - {c.label}: step {_fmt_s(c.step_s)}, memory {_fmt_bytes(c.peak_bytes)}: {why}")
        untimed = [c for c in self.candidates if c.step_s is None and c.excluded
                   and (c.schedule, tuple(c.options.items())) not in shown]
        for c in untimed[:runners_up]:
            lines.append(f"  - {c.label}: {c.excluded}")
        if len(untimed) > runners_up:
            lines.append(f"  ... and {len(untimed) - runners_up} more not simulated")
        lines.extend("  note: " + n for n in self.notes)
        return "\n".join(lines)


def _fmt_s(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _fmt_bytes(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2 ** 20:.1f} MiB"


# ---- candidates ---------------------------------------------------------------------------------

def option_grid(cls, setting: Setting, num_layers: int) -> list:
    """The option sets tried for a schedule: chunks per rank, Chimera's pipelines and orders (a plugin schedule:
    its defaults)."""
    d = setting.stages
    grids = [{}]
    if "chunks" in cls.options:
        grids = [{"chunks": v} for v in range(1, MAX_CHUNKS + 1) if v * d <= num_layers]
    if "pipelines" in cls.options and "order" in cls.options:
        pipes = [f for f in range(1, d // 2 + 1) if d % 2 == 0 and (d // 2) % f == 0] or [1]
        grids = [{"pipelines": f, "order": o} for f in pipes for o in CHIMERA_ORDERS]
    # asynchronous schedules keep their default fill ("call"): "continuous" needs the script to drain()
    return grids


def enumerate_candidates(setting: Setting, num_layers: int) -> list:
    """(schedule class, options) pairs, and Candidates excluded before any pricing (with the reason)."""
    pairs, excluded = [], []
    for name, cls in sorted(registry.available().items()):
        if not cls.synchronous and not setting.allow_asynchronous:
            excluded.append(Candidate(name, {}, "-", excluded="asynchronous: it changes the optimisation (stale or "
                                                             "predicted weights); allow with allow_asynchronous"))
            continue
        for options in option_grid(cls, setting, num_layers):
            pairs.append((cls, options))
    return pairs, excluded


# ---- pricing ------------------------------------------------------------------------------------

def _costs(profile: Profile, parts: list, setting: Setting, placement) -> Costs:
    """The simulator's non-compute costs on this profile: one message (the mean boundary size) and one
    stage's gradient all-reduce (the mean stage size, over its replicas and data-parallel copies), with the
    runtime's host time per message and per compute action; and one stage's optimizer step (under ZeRO each
    data-parallel rank steps its 1/DP share)."""
    links = profile.links
    outs = boundary_bytes(profile.layers, parts)
    grads = stage_sums(profile.layers, parts, "param_bytes")
    mean_out = sum(outs) / len(outs)
    mean_grad = sum(grads) / len(grads)
    members = max(len(placement.stage_group(s)) for s in range(placement.num_stages)) * setting.data_parallel
    return Costs(fwd=1.0, bwd=1.0, wgrad=0.0, comm=links.message_s(mean_out),
                 allreduce=links.allreduce_s(mean_grad, members), send=links.send_s, recv=links.recv_s,
                 sync_post=links.sync_post_s if members > 1 else 0.0, dispatch=links.dispatch_s,
                 step=_stage_step(profile, setting))


def _stage_step(profile: Profile, setting: Setting) -> float:
    """One stage's optimizer step on this setting: the profile's was timed on a mean stage of the pipeline it was
    measured for (a reused profile_file may have had another), and under ZeRO each data-parallel rank steps 1/DP."""
    measured_for = profile.meta.get("optimizer_step_stages") or setting.stages
    return profile.optimizer_step_s * measured_for / setting.stages / (setting.data_parallel if setting.zero else 1)


def _compute_bound(placement, stage_time: list) -> float:
    """No step is shorter than its busiest rank's own compute."""
    busy = [0.0] * placement.num_ranks
    for c in placement.chunks:
        busy[c.rank] += stage_time[c.stage] * len(placement.micro_batches_of(c.replica))
    return max(busy)


def plan(profile: Profile, setting: Setting, budget: Budget = Budget(), cuts=CUT_METHODS,
         exhaustive: bool = False, only=None, accept=None) -> PlanResult:
    """Search schedules x options x cuts; return the fastest that fits ``budget`` and every candidate's fate.

    ``exhaustive``: simulate every candidate that fits (the sweep the benchmark compares with), not
    only those whose bound can beat the best. ``only``: restrict to these schedule names.
    ``accept(placed_schedule)``: None if the job can run that placement, else why not (Megatron's
    chunks, already built, fix which stages each rank holds).
    """
    begin = time.perf_counter()
    layers = list(profile.layers)
    pairs, candidates = enumerate_candidates(setting, len(layers))
    if only is not None:
        pairs = [(cls, o) for cls, o in pairs if cls.name in only]
        candidates = [c for c in candidates if c.schedule in only]
    per_param = state_bytes_per_param(setting.precision, setting.zero, setting.data_parallel,
                                      profile.optimizer_state_bytes_per_param)
    # stage 1: placements (cheap), cuts and bounds; what cannot fit by its weights alone is dropped here
    staged = []
    cut_cache: dict = {}
    for cls, options in pairs:
        try:
            placed = cls.placed(setting.stages, setting.micro_batches, **options)
            _check_setting(placed, setting)
        except ValueError as exc:
            candidates.append(Candidate(cls.name, dict(options), "-", excluded=str(exc)))
            continue
        why = accept(placed) if accept is not None else None
        if why:
            candidates.append(Candidate(cls.name, dict(options), "-", excluded=why))
            continue
        num_stages = placed.placement.num_stages
        for method in cuts:
            key = (num_stages, method)
            if key not in cut_cache:
                try:
                    parts = cut(layers, num_stages, method)
                except ValueError as exc:
                    cut_cache[key] = exc
                else:
                    cut_cache[key] = (parts, stage_costs(layers, parts, setting.checkpoint_interval))
            entry = cut_cache[key]
            cand = Candidate(cls.name, dict(options), method)
            candidates.append(cand)
            if isinstance(entry, ValueError):
                cand.excluded = str(entry)
                continue
            parts, sc = entry
            cand.parts = list(parts)
            if setting.checkpoint_interval and placed.splits_backward:
                cand.excluded = ("activation checkpointing: a split backward recomputes each checkpointed block "
                                 "twice (docs/limits.md)")
                continue
            weights_floor = per_param * max(rank_params(placed.placement, stage_sums(layers, parts, "params")))
            if budget.memory_bytes is not None and weights_floor > budget.memory_bytes:
                cand.excluded = (f"model states alone need {_fmt_bytes(weights_floor)} on a rank, over the "
                                 f"{_fmt_bytes(budget.memory_bytes)} budget")
                continue
            bound = _compute_bound(placed.placement, [f + b for f, b in zip(sc.fwd, sc.bwd)])
            staged.append((bound, cls, options, cand, sc))
    # stage 2: in order of the bound, build, check memory, simulate; skip what cannot beat the best
    staged.sort(key=lambda item: item[0])
    built: dict = {}
    best = None
    simulated = 0
    for bound, cls, options, cand, sc in staged:
        if best is not None and not exhaustive and bound >= best.step_s:
            cand.excluded = (f"not simulated: its busiest rank alone computes {_fmt_s(bound)}, no faster than "
                             f"{best.label} ({_fmt_s(best.step_s)})")
            continue
        key = (cls.name, tuple(sorted(options.items())))
        if key not in built:
            schedule = cls(setting.stages, setting.micro_batches, **options)
            built[key] = (schedule, schedule.lower())
        schedule, program = built[key]
        layer_params = stage_sums(layers, cand.parts, "params")
        out_bytes = boundary_bytes(layers, cand.parts)
        cand.memory = rank_memory(schedule, program, layer_params, list(sc.activations), out_bytes,
                                  precision=setting.precision, zero=setting.zero,
                                  data_parallel=setting.data_parallel,
                                  optimizer_bytes=profile.optimizer_state_bytes_per_param)
        cand.peak_micro_batches = max(activation_peaks(schedule.orders))
        why = _over_budget(cand, budget)
        if why:
            cand.excluded = why
            continue
        if setting.zero >= 2:
            from ..schedules.sharding import shard
            program_run = shard(program, setting.zero)
        else:
            program_run = program
        result = simulate(program_run, _costs(profile, cand.parts, setting, schedule.placement),
                          data_parallel=setting.data_parallel,
                          stage_costs=sc)
        simulated += 1
        if not result.valid:
            cand.excluded = f"invalid program: {(result.errors or list(result.deadlock.values()))[:1]}"
            continue
        cand.step_s = result.makespan
        if best is None or cand.step_s < best.step_s - 1e-12:
            best = cand
    out = PlanResult(best, candidates, setting, budget, time.perf_counter() - begin, simulated)
    if best is not None:
        out.notes.append("step times are the simulator's on the measured costs" + (
            f", with the optimizer step ({_fmt_s(profile.optimizer_step_s)} per stage's weights)"
            if profile.optimizer_step_s else ", without the optimizer step (not measured in this profile)"))
    return out


def _check_setting(schedule, setting: Setting) -> None:
    """The job's own limits on a schedule (ZeRO over replicas, asynchronous with ZeRO-2/3, what tensor parallelism
    admits), as the runtime checks them."""
    from ..config import PipelineConfig, check_tensor_parallel
    PipelineConfig(schedule=schedule.name, zero_stage=setting.zero).check_schedule(schedule)
    check_tensor_parallel(schedule, setting.tensor_parallel, setting.zero)


def _over_budget(cand: Candidate, budget: Budget) -> str | None:
    if budget.max_activations is not None and cand.peak_micro_batches > budget.max_activations + 1e-9:
        return (f"holds {cand.peak_micro_batches:g} micro-batches of activations on a rank, over the limit of "
                f"{budget.max_activations:g}")
    if budget.memory_bytes is not None and cand.peak_bytes > budget.memory_bytes:
        worst = max(cand.memory, key=lambda m: m.total)
        return (f"needs {_fmt_bytes(worst.total)} on a rank (model states {_fmt_bytes(worst.model_states)}, "
                f"activations {_fmt_bytes(worst.activations)}), over the {_fmt_bytes(budget.memory_bytes)} budget")
    return None
