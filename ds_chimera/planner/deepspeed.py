"""``"pipeline": {"schedule": "auto"}`` in ``deepspeed.initialize``: profile, plan, then run the choice.

When: at ``initialize``, before any layer is rebuilt, on the first micro-batch of the
``training_data`` the script passes (as DeepSpeed's own pipeline examples do), or on the
``micro_batch`` its caller took (the HF Trainer: the first batch of its dataloader). A script that
passes no ``training_data`` names a ``profile_file`` written by an earlier run, or is told how.

Where: global rank 0 (a first stage's device) times the layers, one built at a time, on that
micro-batch (with its tensor group, on a tensor-parallel topology: each tensor rank times its shard, and the
profile is rank 0's, per tensor rank); every rank then measures the links with its neighbours; rank 0 plans and sends the
chosen ``"pipeline"`` section to every rank, so all build the same schedule, options and cut.
The result is exactly what naming that section by hand runs (``plan_file`` writes it).

A failure on one rank while it profiles, measures or plans is raised on every rank where they agree on it
(rank 0's, broadcast); otherwise (a tensor rank's, a neighbour's in the links) the caller runs this under
the runtime's fault guard, which ends every rank within seconds, naming the rank it came from.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os

import torch

from ..agreed import on_every_rank
from ..logs import get_logger
from ..named_files import load_json, read_named_file
from ..tensor_tree import to_device
from .memory import GIB
from .optimizer_cost import measured_step_s
from .profile import Profile, profile_layers, rng_devices
from .search import Budget, Setting, plan

log = get_logger()

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "lamb": 8, "fusedlamb": 8,
                         "adagrad": 4, "sgd": 0}


def resolve(module, pipeline, config: dict, training_data=None, collate_fn=None, optimizer=None, micro_batch=None,
            defer: bool = False, host_cost=None, guard=None):
    """The PipelineConfig with ``auto`` replaced by the planner's choice (every rank, same answer).

    ``micro_batch``: the (inputs, labels) pair to profile on, instead of the first micro-batch of
    ``training_data`` (only rank 0's is used; other ranks may pass :data:`ON_RANK0`). ``defer``: with no data
    to profile on (and no plan or profile file), return None instead of raising: the caller plans at the first
    ``train_batch`` (:mod:`.deferred`). ``host_cost``: the runtime's measurement of its host time per compute
    action (``runtime.host_cost.measure_dispatch``, or a callable taking its ``rounds``, ``idle_s`` and ``busy_s``
    keywords), taken with the links (:func:`.links.measure_links`) on CPU ranks, around layers shaped as the
    model's where they leave the core idle (:func:`_around_layers`). ``guard``: a callable returning the runtime's
    fault guard (``runtime.faults``), which the steps whose collectives a failure on one rank would strand run in;
    an error every rank raises together is raised outside it, or marked (:mod:`ds_chimera.agreed`)."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from .links import measure_links
    guard = guard or contextlib.nullcontext
    options = dict(pipeline.options)
    rank = dist.get_rank()
    reused = _saved_plan(options.get("plan_file"), dist)
    if reused is not None:            # a rerun (a resume) runs what the first run chose, without planning again
        log.info("schedule auto: running the plan in %s (delete the file to plan again): %s",
                 options["plan_file"], reused)
        decision = {"pipeline": reused, "step_s": None, "peak_bytes": None, "plan_file": str(options["plan_file"])}
        return _reused_plan(pipeline, reused, options["plan_file"], module, decision)
    grid = module._grid
    stages, dp = grid.pipe_parallel_size, grid.data_parallel_size
    profilers = profiling_ranks(grid)
    device = torch.device(get_accelerator().device_name(module.local_rank))
    micro_batches = pipeline.batch.micro_batches(dp)
    setting = Setting(stages=stages, micro_batches=micro_batches, data_parallel=dp, precision=pipeline.precision,
                      tensor_parallel=grid.get_slice_parallel_world_size(),
                      zero=pipeline.zero_stage, checkpoint_interval=pipeline.checkpoint_interval(module.activation_checkpoint_interval),
                      allow_asynchronous=bool(options.get("allow_asynchronous")))
    profile_file = options.get("profile_file")
    profile = _saved_profile(profile_file, dist)
    if profile is not None:
        if profile.num_layers != len(module._layer_specs):
            raise ValueError(f'"pipeline": profile_file {profile_file!r} profiles {profile.num_layers} layers; this '
                             f"PipelineModule has {len(module._layer_specs)}: delete it to profile again")
    elif training_data is None and micro_batch is None:
        if defer:
            return None
        raise ValueError('"schedule": "auto" times your layers on a micro-batch of your data: pass training_data to '
                         "deepspeed.initialize (as DeepSpeed's pipeline examples do), or name a profile_file or "
                         "plan_file an earlier run wrote, or name a schedule")
    measured_now = profile is None
    if measured_now:
        taken = {}

        def take_micro_batch():     # the data's errors: rank 0's, raised on every rank
            if micro_batch is not None:
                taken["batch"] = (to_device(micro_batch[0], device), to_device(micro_batch[1], device))
            else:
                with torch.random.fork_rng(devices=rng_devices(device)):  # the loader's draws
                    taken["batch"] = first_micro_batch(training_data, collate_fn, _micro_batch_size(pipeline, dp),
                                                       device)
            return {"ok": True}

        def profiled():
            if rank == 0:
                log.info("schedule auto: profiling %d layers on %s%s", len(module._layer_specs), device,
                         f" with tensor ranks {profilers}" if len(profilers) > 1 else "")
            measured = profile_module(module, taken["batch"], pipeline, dp, device,
                                      _optimizer_state_bytes(config, optimizer),
                                      agree=_agree_in_tensor_group(grid, device) if len(profilers) > 1 else None)
            step_s = measured_step_s(config, optimizer, [layer.params for layer in measured.layers], stages, device)
            return dataclasses.replace(measured, optimizer_step_s=step_s,
                                       meta={**measured.meta, "optimizer_step_stages": stages}).to_json()
        with guard():
            _on_rank0_for_all(take_micro_batch, "taking the first micro-batch to profile", dist, also=profilers)
            # the tensor group's layers run collectives together: a failure strands the peers (see the function)
            profile = Profile.from_json(_on_rank0_for_all(profiled, "profiling the layers", dist, also=profilers,
                                                          together=len(profilers) > 1))
    # the first data-parallel copy's (and tensor rank's) first two stages, the same two ranks on every rank: the
    # pair's group is created by every rank with the same members (each copy naming its own pair made groups
    # whose members differed between ranks under one name: a rendezvous that could pair the wrong ranks and hang)
    first = grid.stage_to_global(stage_id=0, **_first_copy(grid))
    second = grid.stage_to_global(stage_id=min(1, stages - 1), **_first_copy(grid))
    big = max(max(layer.output_bytes for layer in profile.layers), 1 << 20)
    grads = max(sum(layer.param_bytes for layer in profile.layers) // max(1, stages), 1 << 20)
    stage_fwd = sum(layer.fwd for layer in profile.layers) / max(1, stages)
    with guard():
        links = measure_links(dist, first, second, grid.get_data_parallel_group(), device, big_bytes=big,
                              reduce_bytes=grads, idle_s=min(max(stage_fwd, 1e-3), 0.05),
                              same_host=_local_ranks() >= 2,
                              pipe_group=grid.get_pipe_parallel_group() if dp == 1 else None,
                              # on an accelerator the host runs ahead of the kernels it launches: its time per action
                              # is on the step's path only when kernels are short, which is not modelled (no GPU lent)
                              host_cost=_around_layers(host_cost, profile.layers) if device.type == "cpu" else None)
        memory_bytes = _memory_budget(options, device, dist)
    profile = dataclasses.replace(profile, links=links)
    budget = Budget(memory_bytes=memory_bytes, max_activations=options.get("max_activations"))

    def planned():
        if measured_now and profile_file:
            profile.save(profile_file)
        result = plan(profile, setting, budget)
        log.info("schedule auto:\n%s", result.report())
        if result.chosen is None:
            return {"error": result.why_nothing()}
        chosen = {"pipeline": result.pipeline_section(), "step_s": result.chosen.step_s,
                  "peak_bytes": result.chosen.peak_bytes}
        if options.get("plan_file"):
            from ..atomic import write_text_atomic
            write_text_atomic(options["plan_file"], json.dumps({"pipeline": chosen["pipeline"]}, indent=1) + "\n")
        return chosen
    with guard():
        decided = _on_rank0_for_all(planned, "planning", dist)
    return pipeline.with_plan(decided["pipeline"], decided)      # with its predicted step and peak memory


def _saved_profile(path, dist) -> Profile | None:
    """The profile an earlier run wrote to ``profile_file`` (rank 0's, sent to every rank); None when there is none."""
    saved = _read_on_rank0(path, dist, lambda found: read_named_file(
        '"pipeline": profile_file', found, Profile.load,
        "delete it to profile again, or name a profile an earlier run of this model wrote").to_json())
    return None if saved is None else Profile.from_json(saved)


IDLE_FLOOR_S = 1e-4       # layers idling less than this, or for less than half their forward (a compute-bound
IDLE_SHARE = 0.5          # layer descheduled now and then), leave the core warm: measured around near-free layers
IDLE_CAP_S, BUSY_CAP_S = 0.003, 0.002    # the core is about as cold after 3 ms idle as after 10; bounds the timing
SHAPED_ROUNDS = 8         # rounds of the host-time measurement around waiting layers: about 2.7 s on CPU


def _around_layers(host_cost, layers):
    """``host_cost`` measured around layers that wait and compute as the model's mean layer does (the profile's
    ``fwd_idle`` and the rest of ``fwd``): after a wait the runtime's code runs on a cold core
    (``runtime.host_cost``). Layers that keep the core busy: around near-free ones, as before."""
    if host_cost is None or not layers:
        return host_cost
    idle = sum(layer.fwd_idle for layer in layers) / len(layers)
    fwd = sum(layer.fwd for layer in layers) / len(layers)
    if idle < IDLE_FLOOR_S or idle < IDLE_SHARE * fwd:
        return host_cost
    return functools.partial(host_cost, rounds=SHAPED_ROUNDS, idle_s=min(idle, IDLE_CAP_S),
                             busy_s=min(max(fwd - idle, 0.0), BUSY_CAP_S))


def _on_rank0_for_all(work, what: str, dist, also=(0,), together: bool = False):
    """``work()`` on rank 0, its result sent to every rank; its failure (or an ``{"error": ...}`` result) is
    raised on every rank (marked :func:`~ds_chimera.agreed.on_every_rank`), not only on rank 0 while the others
    wait for the result. ``also``: the ranks that run ``work()`` with rank 0 (its tensor group, when the work runs
    tensor-parallel layers); rank 0's result counts. ``together``: those ranks run collectives with each other
    inside ``work()``, so one that fails leaves its peers waiting in a collective it never joins, and they never
    reach the broadcast: its failure is raised at once, on it alone, for the caller's fault guard
    (``runtime.faults``) to end every rank within seconds, naming it."""
    rank = dist.get_rank()
    stranding = together and len(also) > 1      # ``also`` holds rank 0 and its peers
    out, mine = [None], None
    if rank != 0 and rank in also:
        try:
            work()
        except Exception as exc:        # noqa: BLE001  (raised below, unless rank 0 reports a failure for all)
            if stranding:
                raise ValueError(_failed(rank, what, exc)) from exc
            mine = exc
    if rank == 0:
        try:
            out[0] = work()
        except Exception as exc:         # noqa: BLE001  (re-raised below, on every rank)
            if stranding:
                raise ValueError(_failed(rank, what, exc)) from exc
            out[0] = {"error": _failed(rank, what, exc), "raised": exc}
    shared = [{k: v for k, v in out[0].items() if k != "raised"} if isinstance(out[0], dict) else out[0]]
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], dict) and "error" in shared[0]:
        raise on_every_rank(ValueError(shared[0]["error"])) from (out[0] or {}).get("raised")
    if mine is not None:                 # this rank's alone: the caller's fault guard ends the others
        raise ValueError(_failed(rank, what, mine)) from mine
    return shared[0]


def _failed(rank: int, what: str, exc: BaseException) -> str:
    return f'"schedule": "auto" failed on rank {rank} while {what}: {type(exc).__name__}: {exc}'


ON_RANK0 = ("the micro-batch", "rank 0 profiles")   # resolve(micro_batch=) on ranks other than 0, deferred planning


def _first_copy(grid) -> dict:
    """The grid coordinates of data-parallel copy 0 (and tensor rank 0, on a tensor-parallel topology)."""
    sliced = "model" in grid.topology().get_axis_names()
    return {"data": 0, **({"model": 0} if sliced else {})}


def profiling_ranks(grid) -> list:
    """The global ranks that profile the layers: rank 0, with its tensor group where the layers are
    tensor-parallel (each such layer runs on all its tensor ranks at once, as in training)."""
    if grid.get_slice_parallel_world_size() == 1:
        return [0]
    return sorted(grid.stage_to_global(stage_id=0, **{**_first_copy(grid), "model": t})
                  for t in range(grid.get_slice_parallel_world_size()))


def _agree_in_tensor_group(grid, device):
    """``agree`` for :func:`~.profile.stable_median`: the tensor group stops timing a layer when its rank 0 does."""
    import torch.distributed as dist
    group = grid.get_slice_parallel_group()
    src = dist.get_global_rank(group, 0)

    def agree(done: bool) -> bool:
        flag = torch.tensor([1.0 if done else 0.0], device=device)
        dist.broadcast(flag, src=src, group=group)
        return bool(flag.item())
    return agree


PLAN_FIX = "delete it to plan again (the run writes a new one), or name the plan_file of this model and layout"


def _saved_plan(path, dist):
    """The ``"pipeline"`` section an earlier run wrote to ``plan_file`` (rank 0's, sent to every rank); None when
    there is none."""
    return _read_on_rank0(path, dist, lambda found: read_named_file('"pipeline": plan_file', found, _plan_section,
                                                                    PLAN_FIX))


def _read_on_rank0(path, dist, read):
    """``read(path)`` where rank 0 has the file, sent to every rank (other nodes may not see it); None when no file
    is named or rank 0 has none. Its ValueError (``read_named_file``'s: the key, the path and the fix) is raised
    on every rank, as one they agree on."""
    found = [None]
    if path and dist.get_rank() == 0 and os.path.exists(path):
        try:
            found[0] = {"value": read(path)}
        except ValueError as exc:
            found[0] = {"error": str(exc)}
    if path:
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None and "error" in found[0]:
        raise on_every_rank(ValueError(found[0]["error"]))
    return None if found[0] is None else found[0]["value"]


def _plan_section(path: str) -> dict:
    """The section of a plan file: ``{"pipeline": {"schedule": NAME, options..., "parts": [0, ..., L]}}``."""
    data = load_json(path)
    section = data.get("pipeline") if isinstance(data, dict) else None
    if not (isinstance(section, dict) and isinstance(section.get("schedule"), str)
            and isinstance(section.get("parts"), list) and all(isinstance(p, int) for p in section["parts"])):
        raise ValueError(f'expected {{"pipeline": {{"schedule": NAME, ..., "parts": [0, ..., layers]}}}}, the shape '
                         f"the planner writes; got {json.dumps(data)[:120]}")
    return section


def _reused_plan(pipeline, section: dict, path, module, decision: dict | None = None):
    """``pipeline`` with the plan file's section, which must fit this model and pipeline (else: the fix)."""
    where = f'"pipeline": plan_file {str(path)!r}'
    try:
        planned = pipeline.with_plan(section, decision)
    except ValueError as exc:
        raise ValueError(f"{where} cannot be used: {exc}; {PLAN_FIX}") from None
    layers, parts = len(module._layer_specs), list(section["parts"])
    stages = module._grid.pipe_parallel_size
    try:
        schedule = planned.build_schedule(stages, planned.batch.micro_batches(module._grid.data_parallel_size))
    except ValueError as exc:
        raise ValueError(f"{where} holds a {section['schedule']!r} plan this run cannot build ({exc}); "
                         f"{PLAN_FIX}") from None
    if parts[-1] != layers or len(parts) != schedule.placement.num_stages + 1:
        raise ValueError(f"{where} was written for {len(parts) - 1} stages over {parts[-1]} layers; this run cuts "
                         f"{layers} layers into {schedule.placement.num_stages} stages ({section['schedule']!r} on "
                         f"{stages} pipeline ranks): {PLAN_FIX}")
    return planned


def profile_module(module, micro_batch, pipeline, dp: int, device, optimizer_bytes: int, agree=None) -> Profile:
    """Time every layer of ``module`` on ``micro_batch`` (inputs, labels, on ``device``).

    The random state is restored afterwards (dropout, layers built from specs draw from it), so the training
    that follows starts exactly as it would without the profile."""
    inputs, labels = micro_batch
    with torch.random.fork_rng(devices=rng_devices(device)):
        loss_fn = module.loss_fn
        if loss_fn is not None:
            def loss(out):
                return loss_fn(out, labels)
        else:
            def loss(out):
                return out if out.dim() == 0 else out.float().mean()
        layers = profile_layers(layer_factories(module, device), inputs, device, loss, agree=agree)
    return Profile(tuple(layers), micro_batch_size=_micro_batch_size(pipeline, dp), device=str(device),
                   optimizer_state_bytes_per_param=optimizer_bytes)


def layer_factories(module, device) -> list:
    """(name, build) per layer of the PipelineModule: a LayerSpec is built on demand, a tied module once."""
    from functools import partial

    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
    from torch import nn
    tied: dict = {}
    out = []
    for idx, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            def build(spec=spec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build().to(device)
                shared = tied[spec.key]
                return shared if spec.forward_fn is None else partial(spec.forward_fn, shared)
            name = f"{idx}:{spec.typename.__name__}[{spec.key}]"
        elif isinstance(spec, LayerSpec):
            def build(spec=spec):
                return spec.build().to(device)
            name = f"{idx}:{spec.typename.__name__}"
        elif isinstance(spec, nn.Module):
            def build(spec=spec):
                return spec.to(device)
            name = f"{idx}:{type(spec).__name__}"
        else:
            def build(spec=spec):
                return spec
            name = f"{idx}:{getattr(spec, '__name__', type(spec).__name__)}"
        out.append((name, build))
    return out


def first_micro_batch(training_data, collate_fn, micro_batch_size: int, device) -> tuple:
    """(inputs, labels) of the first micro-batch, as DeepSpeed's loader would batch it, on ``device``."""
    loader = torch.utils.data.DataLoader(training_data, batch_size=micro_batch_size, collate_fn=collate_fn)
    batch = next(iter(loader))
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("schedule auto: a pipeline's training_data yields (inputs, labels) pairs; its first batch "
                         f"is a {type(batch).__name__}")
    return to_device(batch[0], device), to_device(batch[1], device)


def _micro_batch_size(pipeline, dp: int) -> int:
    batch = pipeline.batch
    if batch.micro_batch_size is not None:
        return batch.micro_batch_size
    if batch.train_batch_size is not None:
        return max(1, batch.train_batch_size // (batch.micro_batches(dp) * dp))
    return 1


def _optimizer_state_bytes(config: dict, optimizer=None) -> int:
    """Optimizer state bytes per parameter: of the optimizer instance passed (or the instance a callable
    rebuilds, its ``template``: the HF Trainer's), else of the config's optimizer, else Adam's 8 (what a
    callable builds is not known until it runs)."""
    optimizer = getattr(optimizer, "template", optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(optimizer, torch.optim.SGD):
            return 4 if any(group.get("momentum") for group in optimizer.param_groups) else 0
        return OPTIMIZER_STATE_BYTES.get(type(optimizer).__name__.lower(), 8)
    section = config.get("optimizer") or {}
    name = str(section.get("type", "adam")).lower()
    if name == "sgd":
        return 4 if (section.get("params") or {}).get("momentum") else 0
    return OPTIMIZER_STATE_BYTES.get(name, 8)


def _memory_budget(options: dict, device, dist) -> float | None:
    """Bytes a rank may use: ``memory_limit_gb``, else the least free memory of any rank's device."""
    if options.get("memory_limit_gb") is not None:
        return float(options["memory_limit_gb"]) * GIB
    free = torch.tensor([_free_bytes(device)], dtype=torch.float64, device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return float(free.item())


def _free_bytes(device) -> float:
    """The device's free memory; on CPU, the host's available memory shared by the ranks on it."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return float("inf")
    return available / _local_ranks()


def _local_ranks() -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, or the DeepSpeed launcher's LOCAL_SIZE."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1"))))
