"""``"auto"`` on Megatron: time the first training call, then run the fastest schedule for the chunks as built.

Megatron builds the model chunks before the first ``forward_backward_func`` call, so which
stages each rank holds (and every weight) is fixed by then: Megatron's own layout (stage
v*D + r on rank r) or what ``build_model_chunks`` built. The planner therefore chooses among
the schedules that run that same placement (1F1B, GPipe, ZB-H1 on one chunk per rank;
interleaved and breadth-first on V; Chimera's orders on Chimera's chunks), all synchronous
and numerically the same training, so switching after the first call changes nothing but
speed and memory.

The first training call runs the layout's reference schedule (ZB-H1 where the config can
split the backward, so the weight-gradient time is measured too; 1F1B otherwise; the
built-for schedule for tagged chunks) with each action timed. Every rank's times go to its
pipeline's first rank; global rank 0's pipeline is the profile, the links are measured on
every rank together, and the profile is broadcast so that every rank plans the same choice
(the planner is deterministic). A later call with another ``num_microbatches`` plans again
from the same profile. The activation budget defaults to the reference schedule's peak
(Megatron's own schedule's), so "auto" never holds more micro-batches than it would.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

import torch
import torch.distributed as dist

from ..agreed import on_every_rank
from ..config import PipelineConfig
from ..logs import get_logger
from ..planner.profile import LayerCost, Profile
from ..planner.search import Budget, Setting, plan
from ..schedules import registry
from ..schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, activation_peaks
from .chunk_checks import check_split_backward
from .model_chunk import model_config, unwrap
from .runner import ScheduleRunner
from .stages import call_pipeline_group, chunks_device

log = get_logger()
BUILT_FOR_AUTO = "auto"


def layout_schedule(chunks: list, config, size: int) -> PipelineConfig:
    """The schedule that runs the chunks as built and times the first call (see the module doc)."""
    built = getattr(chunks[0], "_ds_chimera_built_for", getattr(unwrap(chunks[0]), "_ds_chimera_built_for", None))
    if built is not None and built[0] != BUILT_FOR_AUTO:
        return PipelineConfig.from_megatron(built[0], dict(built[1]), where="build_model_chunks")
    if len(chunks) > 1:
        return PipelineConfig.from_megatron("interleaved", {"chunks": len(chunks)}, where="auto")
    try:
        check_split_backward(PipelineConfig(schedule="zb-h1").build_schedule(size, max(2, size)), config, 0)
    except ValueError:
        return PipelineConfig.from_megatron("1f1b", {}, where="auto")
    return PipelineConfig.from_megatron("zb-h1", {}, where="auto")


def reference_schedule(layout: PipelineConfig) -> PipelineConfig:
    """Whose activation peak is the default budget: Megatron's own schedule for its layouts (1F1B for ZB-H1)."""
    return PipelineConfig(schedule="1f1b") if layout.schedule == "zb-h1" else layout


def rank_stages(placement) -> tuple:
    """Each rank's stages in chunk order: what the built chunks fix."""
    return tuple(tuple(placement.chunks[c].stage for c in placement.chunks_on(r)) for r in range(placement.num_ranks))


def stage_times(records: list, placement) -> dict:
    """{stage: {kind: [seconds]}} from one call's action records (rank, kind, chunk, mb, start, end)."""
    out: dict = {}
    for _, kind, chunk, _, start, end in records:
        stage = placement.chunks[chunk].stage
        out.setdefault(stage, {}).setdefault(str(kind), []).append(end - start)
    return out


def stage_cost(stage: int, times: dict, params: int, param_bytes: int, out_bytes: int) -> LayerCost:
    """One stage's LayerCost from its actions' medians; ``wgrad`` is -1 where the backward was not split."""
    med = {kind: statistics.median(values) for kind, values in times.items()}
    fwd = med.get(str(FORWARD), 0.0)
    if str(WEIGHT_GRAD) in med:
        wgrad = med[str(WEIGHT_GRAD)]
        bwd = med.get(str(INPUT_GRAD), med.get(str(BACKWARD), 0.0)) + wgrad
    else:
        wgrad, bwd = -1.0, med.get(str(BACKWARD), med.get(str(INPUT_GRAD), 0.0))
    return LayerCost(name=f"stage {stage}", fwd=fwd, bwd=bwd, wgrad=wgrad, activation_bytes=0,
                     output_bytes=out_bytes, param_bytes=param_bytes, params=params)


def sent_bytes(p2p) -> int:
    """The largest message this rank sent in the call (the shapes the transport recorded per edge)."""
    largest = 0
    for meta in p2p.sent_meta.values():
        largest = max(largest, sum(torch.empty((), dtype=dtype).element_size() * math.prod(shape)
                                   for dtype, _, shape in meta))
    return largest


class AutoRunner:
    """Megatron's forward-backward contract under ``"auto"``: profile the first training call, then plan."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.options = dict(config.options)
        self._runner_class = ScheduleRunner
        self.layout = None              # PipelineConfig of the chunks' schedule (runs until the plan)
        self.profile = None             # Profile of the stages, the same on every rank
        self.decisions: dict = {}       # (pipeline size, num_microbatches) -> PipelineConfig
        self.reports: dict = {}         # ... -> the planner's report (text)
        self.predicted: dict = {}       # ... -> the chosen schedule's predicted step (seconds)
        self.advice: dict = {}          # ... -> a faster placement, to build next time (or None)
        self._runners: dict = {}
        self.fixed = None               # each rank's stages, as the chunks were built
        self.plans: list = []           # rank 0: what plan_file holds
        self._plans_read = False
        self._group = None              # the pipeline group all this was learnt on

    def _forget(self) -> None:
        """Megatron's model-parallel state was destroyed and built again (new groups, maybe other chunks):
        what was measured and decided on the old one no longer holds."""
        self.layout = self.profile = self.fixed = None
        self.decisions, self.reports, self.predicted, self.advice = {}, {}, {}, {}
        self._runners, self.plans, self._plans_read = {}, [], False

    def _runner(self, config: PipelineConfig):
        key = (config.schedule, json.dumps(dict(config.options), sort_keys=True))
        if key not in self._runners:
            self._runners[key] = self._runner_class(PipelineConfig(schedule=config.schedule, options=config.options,
                                                                   timeout_s=self.config.timeout_s))
        return self._runners[key]

    def __call__(self, **kwargs):
        chunks = kwargs["model"]
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        group = call_pipeline_group(kwargs.get("pg_collection"))
        if self._group is not None and group is not self._group:
            self._forget()
        self._group = group
        size = dist.get_world_size(group)
        if self.layout is None:
            self.layout = layout_schedule(chunks, model_config(chunks[0]), size)
        n = kwargs["num_microbatches"]
        if not self._plans_read:
            self._read_plans()
        if (size, n) in self.decisions:
            return self._runner(self.decisions[(size, n)])(**kwargs)
        if self.profile is None:
            runner = self._runner(self.layout)
            if kwargs.get("forward_only"):          # evaluation before any training: the layout's schedule
                return runner(**kwargs)
            runner.trace_next = True
            result = runner(**kwargs)
            self.fixed = rank_stages(runner.last_schedule.placement)
            # collectives on every rank: one rank's failure in them ends every rank, naming it (runtime/faults.py)
            with runner.guard("schedule auto (Megatron): the profile of the first call, the links and the plan"):
                self.profile = self._measure(runner, chunks, group, size, n)
                self._decision(size, n)              # planned now, so the report follows the first step
            return result
        return self._runner(self._decision(size, n))(**kwargs)

    def _read_plans(self) -> None:
        """Plans an earlier run wrote to ``plan_file`` (rank 0 reads, every rank gets them): a rerun, or a
        resume, runs them as written, without profiling; other shapes are planned as usual."""
        self._plans_read = True
        path = self.options.get("plan_file")
        if not path:
            return
        found = [None]
        if dist.get_rank() == 0 and os.path.exists(path):
            try:
                with open(path) as fh:
                    found[0] = json.load(fh)["plans"]
                found[0] = [(int(p["pipeline_size"]), int(p["num_microbatches"]), str(p["schedule"]),
                             dict(p["options"]), p.get("predicted_step_s")) for p in found[0]]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                found[0] = f"plan_file {str(path)!r} is not a plan this planner wrote ({exc}); delete it to plan again"
        dist.broadcast_object_list(found, src=0)
        if isinstance(found[0], str):
            raise ValueError(found[0])
        for size, n, schedule, options, predicted in found[0] or ():
            self.decisions[(size, n)] = PipelineConfig.from_megatron(schedule, {**options,
                                                                               "timeout": self.config.timeout_s})
            self.plans.append({"pipeline_size": size, "num_microbatches": n, "schedule": schedule,
                               "options": options, "predicted_step_s": predicted})
        if found[0] and dist.get_rank() == 0:
            log.info("schedule auto (Megatron): running the plans in %s (delete the file to plan again)", path)

    def _decision(self, size: int, n: int) -> PipelineConfig:
        if (size, n) not in self.decisions:
            self.decisions[(size, n)] = self._plan(size, n)
        return self.decisions[(size, n)]

    # ---- profile ---------------------------------------------------------------------------
    def _measure(self, runner, chunks, group, size: int, n: int) -> Profile:
        """The stages' costs from the timed call, gathered to every rank; the links measured by all."""
        from ..planner.deepspeed import _local_ranks, _on_rank0_for_all
        from ..planner.links import measure_links
        schedule = runner.last_schedule
        placement = schedule.placement
        local = placement.chunks_on(runner.rank)
        mine = {"times": stage_times(runner.last_records, placement),
                "params": {placement.chunks[c].stage: _param_counts(chunk) for c, chunk in zip(local, chunks)},
                "sent": sent_bytes(runner.p2p)}
        gathered = [None] * size
        dist.all_gather_object(gathered, mine, group=group)

        def stages_profile() -> dict:
            times: dict = {}
            params: dict = {}
            for part in gathered:
                for stage, kinds in part["times"].items():
                    for kind, values in kinds.items():
                        times.setdefault(stage, {}).setdefault(kind, []).extend(values)
                params.update(part["params"])
            out_bytes = max(part["sent"] for part in gathered)
            layers = tuple(stage_cost(s, times[s], *params[s], out_bytes) for s in range(placement.num_stages))
            return Profile(layers, micro_batch_size=1, device=str(chunks_device(chunks)),
                           meta={"profiled_with": self.layout.schedule, "micro_batches": n}).to_json()
        # rank 0's failure is raised on every rank (the others would wait for the profile until the timeout)
        profile = Profile.from_json(_on_rank0_for_all(stages_profile, "building the stages' profile", dist))
        ranks = _group_ranks(group)
        stage_fwd = sum(layer.fwd for layer in profile.layers) / max(1, size)
        first = [None]
        if dist.get_rank() == 0:
            first[0] = ranks[:2] if len(ranks) > 1 else ranks * 2
        dist.broadcast_object_list(first, src=0)
        links = measure_links(dist, first[0][0], first[0][1], None, chunks_device(chunks),
                              big_bytes=max(profile.layers[0].output_bytes, 1024),
                              reduce_bytes=max(max(layer.param_bytes for layer in profile.layers), 1024),
                              idle_s=min(max(stage_fwd, 1e-3), 0.05), same_host=_local_ranks() >= 2)
        return dataclasses.replace(profile, links=links)

    # ---- plan ------------------------------------------------------------------------------
    def _plan(self, size: int, n: int) -> PipelineConfig:
        """The fastest schedule on the profile that runs the built placement within the activation budget."""
        fixed = self.fixed
        w_measured = all(layer.wgrad >= 0 for layer in self.profile.layers)

        def accept(placed):
            if rank_stages(placed.placement) != fixed:
                return (f"places stages {list(map(list, rank_stages(placed.placement)))} on the ranks; the chunks "
                        f"were built as {list(map(list, fixed))}")
            if not w_measured and placed.splits_backward:
                return (f"splits the backward, which the chunks' config does not allow (or the first call, run "
                        f"under {self.layout.schedule}, did not time the weight gradient apart)")
            return None

        limit = self.options.get("max_activations")
        if limit is None:
            reference = reference_schedule(self.layout)
            try:
                limit = max(activation_peaks(reference.build_schedule(size, n).orders))
            except ValueError:
                limit = min(size, n)
        layers = tuple(layer if layer.wgrad >= 0 else _unsplit(layer) for layer in self.profile.layers)
        profile = Profile(layers, self.profile.links, meta=self.profile.meta)
        setting = Setting(stages=size, micro_batches=n)
        result = plan(profile, setting, Budget(max_activations=limit), cuts=("uniform",), accept=accept)
        result.notes.append("Megatron's chunks are built: every candidate holds the same weights, so memory is "
                            "compared in micro-batches of activations (their bytes are not measured here)")
        report = result.report()
        if result.chosen is None:     # every rank plans the same profile: every rank raises it
            raise on_every_rank(ValueError(f"schedule auto on Megatron: {result.why_nothing()}"))
        advice = placement_advice(profile, setting, Budget(max_activations=limit), result.chosen, fixed, w_measured)
        self.advice[(size, n)] = advice
        if advice is not None:
            report += "\n  " + advice["text"]
        self.reports[(size, n)] = report
        chosen = PipelineConfig(schedule=result.chosen.schedule, options=dict(result.chosen.options),
                                timeout_s=self.config.timeout_s)
        self.predicted[(size, n)] = result.chosen.step_s
        if dist.get_rank() == 0:
            log.info("schedule auto (Megatron, profiled under %s):\n%s", self.layout.schedule, report)
            self.plans.append({"pipeline_size": size, "num_microbatches": n, "schedule": chosen.schedule,
                               "options": dict(chosen.options), "predicted_step_s": result.chosen.step_s})
            path = self.options.get("plan_file")
            if path:      # every plan so far; --pipeline-schedule NAME --pipeline-schedule-options JSON reruns one
                from ..atomic import write_text_atomic
                write_text_atomic(os.fspath(path), json.dumps({"plans": self.plans}, indent=1) + "\n")
        return chosen


ADVICE_MARGIN = 0.97    # another placement is advised when its predicted step is below this share of the chosen
MAX_ADVISED_COPIES = 2  # ... and each rank holds at most this many stages' weights (Chimera's two directions)


def _weight_copies(placement) -> int:
    return max(len(placement.chunks_on(r)) for r in range(placement.num_ranks))


def placement_advice(profile: Profile, setting: Setting, budget: Budget, chosen, fixed, w_measured: bool):
    """The fastest schedule that needs chunks built another way, where it beats ``chosen`` clearly.

    Only placements with the built stages (the same layers per stage, so the measured stage costs
    price them exactly) are priced: Chimera's, on Megatron's one chunk per rank. They hold more
    weights (each rank a replica of a second stage; at most ``MAX_ADVISED_COPIES`` stages' worth
    are advised), which the activation budget does not weigh, so this is advice for the next
    launch, with the call that builds those chunks, not a switch.
    Returns None, or {"schedule", "options", "step_s", "ratio", "weight_copies", "text"}."""

    def accept(placed):
        if rank_stages(placed.placement) == fixed:
            return "the built placement (chosen among above)"
        if _weight_copies(placed.placement) > MAX_ADVISED_COPIES:
            return f"holds more than {MAX_ADVISED_COPIES} stages' weights per rank"
        if not w_measured and placed.splits_backward:
            return "splits the backward, which was not timed apart"
        return None

    result = plan(profile, setting, budget, cuts=("uniform",), accept=accept)
    best = result.chosen
    if best is None or best.step_s >= ADVICE_MARGIN * chosen.step_s:
        return None
    copies = _weight_copies(registry.get(best.schedule).placed(setting.stages, setting.micro_batches,
                                                               **best.options).placement)
    args = "".join(f", {k}={v!r}" for k, v in best.options.items())
    text = (f"another placement would be faster: {best.label.replace(' cut=uniform', '')}, predicted "
            f"{best.step_s * 1e3:.3f} ms ({best.step_s / chosen.step_s:.3f}x the chosen), each rank holding "
            f"{copies} stages' weights; build the chunks with build_model_chunks(provider, {best.schedule!r}{args}) "
            f"to run it (V-shaped and looped placements halve Megatron's stages: not priced, their costs are "
            f"unmeasured)")
    return {"schedule": best.schedule, "options": dict(best.options), "step_s": best.step_s,
            "ratio": best.step_s / chosen.step_s, "weight_copies": copies, "text": text}


def _unsplit(layer: LayerCost) -> LayerCost:
    """A stage whose weight-gradient time is unmeasured: priced unsplit (split candidates are refused)."""
    from dataclasses import replace
    return replace(layer, wgrad=0.0)


def _param_counts(chunk) -> tuple:
    params = [p for p in chunk.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def _group_ranks(group) -> list:
    return dist.get_process_group_ranks(group) if group is not dist.group.WORLD else list(range(dist.get_world_size()))
