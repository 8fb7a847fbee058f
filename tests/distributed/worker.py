"""Multi-rank scenarios, run once per test session by torchrun (4 gloo ranks on CPU).

Usage: torchrun --nproc_per_node 4 worker.py OUT.json SCENARIO[,SCENARIO...]
Each scenario trains a small PipelineModule with a ds_chimera schedule (or DeepSpeed's
stock engine) and compares it with single-process training on the same global batches.
Rank 0 writes {scenario: result} to OUT.json; tests assert on it.
"""
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as tdist

import deepspeed
import ds_chimera  # noqa: F401  (installs the "pipeline": {"schedule": ...} switch)
from deepspeed.pipe import PipelineModule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenarios import run_scenarios  # noqa: E402
from models import (BASE_SEED, CountingTanh, build_reference, make_global_batches, mlp_specs,  # noqa: E402
                    reference_params, run_reference)

LR, MICRO = 0.05, 2
# Far above every gradient norm of these runs: the program's CLIP computes the global norm
# (compared with the reference's) but never scales, so a wrong gradient scale (a missing
# 1/N, a data-parallel sum where a mean belongs) moves the weights. A clipped step would
# hide it: clipping rescales whatever the norm was.
NO_CLIP = 1e6


def config(schedule, n, dp, clip=0.5, **options):
    cfg = {"train_batch_size": n * MICRO * dp, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": clip, "steps_per_print": 1000}
    if schedule == "program":          # a program file instead of a schedule name
        cfg["pipeline"] = {"timeout": 60, **options}
    elif schedule is not None:
        cfg["pipeline"] = {"schedule": schedule, "timeout": 60, **options}
    return cfg


def make_engine(stages, cfg, specs, activation_checkpoint_interval=0):
    net = PipelineModule(layers=specs, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         seed_layers=True, base_seed=BASE_SEED,
                         activation_checkpoint_interval=activation_checkpoint_interval)
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg,
                                           optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))
    return engine


def my_batches(engine, global_batches, step, n):
    dp_id = engine.grid.get_data_parallel_id()
    return global_batches(step)[dp_id * n:(dp_id + 1) * n]


def local_layers(engine):
    """global layer index -> module, for whatever engine (ours or stock)."""
    if hasattr(engine, "chunk_modules"):
        return {idx: obj for idx, (_, obj) in engine._layer_objects().items()}
    module = engine.module
    return {module._local_start + i: f for i, f in enumerate(module.forward_funcs)}


def _comm_device():
    """NCCL all-reduces CUDA tensors only; gloo takes CPU ones."""
    return "cuda" if tdist.get_backend() == "nccl" else "cpu"


def max_param_diff(engine, ref_layers, counted=None):
    """Largest difference from the reference over every rank's layers (all-reduced MAX).

    Counts what it compares: each layer's parameter lists must have the same length, and
    ``counted`` (a dict) receives the number of tensors compared over all ranks, so that an
    empty comparison cannot pass as a zero difference.
    """
    worst, tensors, layers = 0.0, 0, set()
    for idx, obj in local_layers(engine).items():
        if isinstance(obj, torch.nn.Module):
            mine, ref = list(obj.parameters()), list(ref_layers[idx].parameters())
            if len(mine) != len(ref):
                raise AssertionError(f"layer {idx}: {len(mine)} parameters against the reference's {len(ref)}")
            for p, q in zip(mine, ref):
                worst = max(worst, (p.detach().float().cpu() - q.detach().float()).abs().max().item())
                tensors += 1
            if mine:
                layers.add(idx)
    t = torch.tensor([worst], device=_comm_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    n = torch.tensor([tensors], device=_comm_device())
    tdist.all_reduce(n)
    covered = [None] * tdist.get_world_size()
    tdist.all_gather_object(covered, sorted(layers))
    covered = set().union(*map(set, covered))
    wanted = {i for i, layer in enumerate(ref_layers) if list(layer.parameters())}
    if n.item() == 0 or covered != wanted:
        raise AssertionError(f"max_param_diff compared {int(n.item())} tensors covering layers {sorted(covered)}; "
                             f"the reference has parameters in layers {sorted(wanted)}")
    if counted is not None:
        counted["tensors"] = int(n.item())
    return t.item()


def replica_spread(engine):
    """Largest difference between replicas of one stage (Chimera's two copies), over all ranks."""
    states = {}
    for idx, obj in local_layers(engine).items():
        if isinstance(obj, torch.nn.Module):
            states[idx] = [p.detach().float().cpu().clone() for p in obj.parameters()]
    gathered = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, states)
    worst, copies = 0.0, 0
    for idx in set().union(*[g.keys() for g in gathered]):
        holders = [g[idx] for g in gathered if idx in g]
        copies = max(copies, len(holders))
        for other in holders[1:]:
            for p, q in zip(holders[0], other):
                worst = max(worst, (p - q).abs().max().item())
    return worst, copies


def train_and_compare(schedule, stages, dp, n, steps=3, tied=False, clip=0.5, aci=0, bf16=False, zero=0,
                      **options):
    specs = mlp_specs(16, tied=tied)
    cfg = config(schedule, n, dp, clip, **options)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if zero:
        cfg["zero_optimization"] = {"stage": zero}
        cfg["zero_allow_untested_optimizer"] = True      # torch SGD under ZeRO-1
    engine = make_engine(stages, cfg, specs, aci)
    global_batches = make_global_batches(n * dp)
    cast = (lambda b: [(x.bfloat16(), y.bfloat16()) for x, y in b]) if bf16 else (lambda b: b)
    CountingTanh.calls = 0
    losses, norms = [], []
    for s in range(steps):
        losses.append(engine.train_batch(iter(cast(my_batches(engine, global_batches, s, n)))).item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    calls = torch.tensor([CountingTanh.calls], device=_comm_device())
    tdist.all_reduce(calls)
    ref_layers = build_reference(specs)
    ref_losses, ref_norms = run_reference(ref_layers, global_batches, steps, LR, clip)
    counted = {}
    result = {"max_param_diff": max_param_diff(engine, ref_layers, counted), "losses": losses,
              "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms, "clip": clip,
              "compared_tensors": counted["tensors"],
              "reference_tensors": sum(1 for layer in ref_layers for _ in layer.parameters()),
              "tanh_forwards_per_micro_batch": calls.item() / (steps * n * dp * sum(
                  1 for spec in specs if getattr(spec, "typename", None) is CountingTanh))}
    result["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    result["replica_spread"], result["copies"] = replica_spread(engine)
    eval_loss = engine.eval_batch(iter(cast(my_batches(engine, global_batches, steps, n)))).item()
    ref_eval = sum(torch.nn.functional.mse_loss(_forward(ref_layers, x), y).item()
                   for x, y in global_batches(steps)) / (n * dp)
    result["eval_diff"] = abs(eval_loss - ref_eval)
    gradients = getattr(getattr(engine, "host", None), "gradients", None)     # ZeRO-1's strategy counts them
    result["zero1_early_chunks"] = getattr(gradients, "early_chunks", None)
    early = torch.tensor([getattr(getattr(engine, "p2p", None), "early_receives", 0)], device=_comm_device())
    tdist.all_reduce(early)
    result["early_receives"] = early.item()
    return result


def zero_compare(schedule, stages, dp, n, zero, steps=3, clip=0.5, **options):
    """ZeRO-2/3 (sharded chunks) with Adam and the clip active, against one-process training:
    weights, losses and gradient norms; the gathers per step and the peak memory."""
    specs = mlp_specs(16)
    cfg = config(schedule, n, dp, clip, **options)
    cfg["zero_optimization"] = {"stage": zero}
    net = PipelineModule(layers=specs, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         seed_layers=True, base_seed=BASE_SEED)
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    shards = engine.host.shards
    global_batches = make_global_batches(n * dp)
    losses, norms, gathers = [], [], []
    for s in range(steps):
        before = shards.gathers()
        losses.append(engine.train_batch(iter(my_batches(engine, global_batches, s, n))).item())
        norms.append(float(engine.get_global_grad_norm()))
        gathers.append(shards.gathers() - before)
    ref_layers = build_reference(specs)
    params = reference_params(ref_layers)
    opt = torch.optim.Adam(params, lr=0.01)
    ref_losses, ref_norms = [], []
    for s in range(steps):
        opt.zero_grad()
        batches, total = global_batches(s), 0.0
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(_forward_grad(ref_layers, x), y) / len(batches)
            loss.backward()
            total += loss.item()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        ref_losses.append(total)
    with engine.gathered_weights():
        counted = {}
        diff = max_param_diff(engine, ref_layers, counted)
    eval_loss = engine.eval_batch(iter(my_batches(engine, global_batches, steps, n))).item()
    ref_eval = sum(torch.nn.functional.mse_loss(_forward(ref_layers, x), y).item()
                   for x, y in global_batches(steps)) / (n * dp)
    return {"max_param_diff": diff, "compared_tensors": counted["tensors"], "losses": losses,
            "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms, "clip": clip, "gathers": gathers,
            "eval_diff": abs(eval_loss - ref_eval), "program_gathers": sum(
                1 for op in engine.plan.program.ops[engine.pipe_rank] if type(op).__name__ == "Gather"),
            "peak": shards.peak, "shard_bytes": shards.memory()["shards"],
            "full_bytes": sum(s.nbytes for s in shards.by_chunk.values()),
            "chunk_bytes": max(s.nbytes for s in shards.by_chunk.values())}


def zero_checkpoint(schedule, zero, n=4, **options):
    """Save under ZeRO-3 and resume exactly; load the weights into an unsharded run, and back."""
    specs, global_batches = mlp_specs(16), make_global_batches(n * 2)
    holder = [tempfile.mkdtemp(prefix="dsc_ckpt_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    root = holder[0]

    def engine_for(stage):
        cfg = config(schedule, n, 2, 0.5, **options)
        cfg["zero_optimization"] = {"stage": stage}
        net = PipelineModule(layers=specs, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                             seed_layers=True, base_seed=BASE_SEED)
        return deepspeed.initialize(model=net, config=cfg, optimizer=lambda p: torch.optim.Adam(p, lr=0.01))[0]

    def weights(engine):
        with engine.gathered_weights():
            return {idx: [p.detach().clone() for p in obj.parameters()] for idx, obj in local_layers(engine).items()
                    if isinstance(obj, torch.nn.Module)}

    def diff(a, b):
        worst = max((p - q).abs().max().item() for idx in a for p, q in zip(a[idx], b[idx], strict=True))
        t = torch.tensor([worst])
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return t.item()
    a = engine_for(zero)
    for s in range(2):
        a.train_batch(iter(my_batches(a, global_batches, s, n)))
    a.save_checkpoint(root, tag="z")
    saved = weights(a)
    for s in range(2, 4):
        a.train_batch(iter(my_batches(a, global_batches, s, n)))
    b = engine_for(zero)                       # the same layout: weights, shards and optimizer state
    b.load_checkpoint(root)
    for s in range(2, 4):
        b.train_batch(iter(my_batches(b, global_batches, s, n)))
    c = engine_for(0)                          # an unsharded run takes the weights
    c.load_checkpoint(root, load_optimizer_states=False, load_lr_scheduler_states=False)
    c.save_checkpoint(root, tag="plain")
    d = engine_for(zero)                       # ... and a sharded one takes them back
    d.load_checkpoint(root, tag="plain", load_optimizer_states=False, load_lr_scheduler_states=False)
    result = {"resume_diff": diff(weights(a), weights(b)), "to_plain_diff": diff(saved, weights(c)),
              "back_diff": diff(saved, weights(d))}
    try:
        engine_for(0).load_checkpoint(root, tag="z")
        result["refusal"] = None
    except ValueError as exc:
        result["refusal"] = str(exc)
    tdist.barrier()
    if tdist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _forward(layers, x):
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x


def checkpoint_resume(schedule, stages, dp, n, load_schedule=None, **options):
    """Train 2 steps, save, train 2 more; a fresh engine loads the save and trains 2: same weights."""
    specs = mlp_specs(16)
    global_batches = make_global_batches(n * dp)
    root = None
    if tdist.get_rank() == 0:
        root = tempfile.mkdtemp(prefix="dsc_ckpt_")
    holder = [root]
    tdist.broadcast_object_list(holder, src=0)
    root = holder[0]
    a = make_engine(stages, config(schedule, n, dp, **options), specs)
    for s in range(2):
        a.train_batch(iter(my_batches(a, global_batches, s, n)))
    a.save_checkpoint(root, tag="step2")
    for s in range(2, 4):
        a.train_batch(iter(my_batches(a, global_batches, s, n)))
    files = sorted(os.listdir(os.path.join(root, "step2"))) if tdist.get_rank() == 0 else []
    cross = load_schedule is not None
    b_cfg = config(load_schedule if cross else schedule, n, dp,
                   **({} if cross or load_schedule == "" else options))
    if load_schedule == "stock":
        b_cfg = config(None, n, dp)
    b = make_engine(stages, b_cfg, specs)
    b.load_checkpoint(root, load_optimizer_states=not cross, load_lr_scheduler_states=not cross)
    result = {"files": files, "latest": open(os.path.join(root, "latest")).read() if tdist.get_rank() == 0 else ""}
    if cross:   # weights must match the saved ones exactly
        ref = build_reference(specs)
        saved = {}
        if tdist.get_rank() == 0:
            for name in files:
                if name.startswith("layer_"):
                    saved[int(name[6:8])] = torch.load(os.path.join(root, "step2", name))
        holder = [saved]
        tdist.broadcast_object_list(holder, src=0)
        for idx, state in holder[0].items():
            ref[idx].load_state_dict(state)
        result["max_param_diff"] = max_param_diff(b, ref)
    else:
        for s in range(2, 4):
            b.train_batch(iter(my_batches(b, global_batches, s, n)))
        worst = 0.0
        la, lb = local_layers(a), local_layers(b)
        for idx, obj in la.items():
            if isinstance(obj, torch.nn.Module):
                for p, q in zip(obj.parameters(), lb[idx].parameters()):
                    worst = max(worst, (p - q).abs().max().item())
        t = torch.tensor([worst])
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        result["max_param_diff"] = t.item()
    tdist.barrier()
    if tdist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return result


def stock_interop(src, dst, n=8):
    """A checkpoint written by one engine, resumed by the other with DeepSpeed's defaults (weights,
    optimizer and scheduler state): both continue exactly alike. No clipping (DeepSpeed's stock
    fp32 pipeline clips on a partial norm, so clipped runs would part for that reason alone)."""
    specs, batches = mlp_specs(16), make_global_batches(n)
    holder = [tempfile.mkdtemp(prefix="dsc_ckpt_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    a = make_engine(4, config(None if src == "stock" else src, n, 1, clip=0.0), specs)
    for s in range(2):
        a.train_batch(iter(batches(s)))
    a.save_checkpoint(holder[0], tag="t")
    b = make_engine(4, config(None if dst == "stock" else dst, n, 1, clip=0.0), specs)
    b.load_checkpoint(holder[0])
    losses = [(a.train_batch(iter(batches(s))).item(), b.train_batch(iter(batches(s))).item()) for s in (2, 3)]
    worst, la, lb = 0.0, local_layers(a), local_layers(b)
    for idx, obj in la.items():
        if isinstance(obj, torch.nn.Module):
            for p, q in zip(obj.parameters(), lb[idx].parameters(), strict=True):
                worst = max(worst, (p - q).abs().max().item())
    t = torch.tensor([worst])
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    tdist.barrier()
    if tdist.get_rank() == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
    return {"losses": losses, "max_param_diff": t.item(), "engines": [type(a).__name__, type(b).__name__]}


def stock_clipping(n=8):
    """DeepSpeed's stock fp32 pipeline clipping against the true global norm, same model and data."""
    specs = mlp_specs(16)
    global_batches = make_global_batches(n)
    out = {}
    for name, schedule in (("stock", None), ("ours", "1f1b")):
        engine = make_engine(4, config(schedule, n, 1, clip=0.05), specs)
        for s in range(3):
            engine.train_batch(iter(my_batches(engine, global_batches, s, n)))
        ref = build_reference(specs)
        run_reference(ref, global_batches, 3, LR, 0.05)
        out[name] = max_param_diff(engine, ref)
    return out


def bad_config(kind):
    specs = mlp_specs(16)
    try:
        if kind == "unknown":
            make_engine(4, config("chimaera", 8, 1), specs)
        elif kind == "pipelines":
            make_engine(4, config("chimera", 8, 1, pipelines=3), specs)
        elif kind == "interleaved-n":
            make_engine(4, config("interleaved", 6, 1), specs)
        elif kind == "option":
            make_engine(4, config("1f1b", 8, 1, chunks=2), specs)
        elif kind == "batch-split":
            cfg = config("chimera", 8, 1)
            cfg.update(train_batch_size=10, train_micro_batch_size_per_gpu=4)
            make_engine(4, cfg, specs)
        elif kind == "stages":            # DeepSpeed's own key, which the module's num_stages overrides
            make_engine(4, config("1f1b", 8, 1, stages=2), specs)
        elif kind == "auto-no-data":      # planned at the first call, which has no data either
            make_engine(4, config("auto", 8, 1), specs).train_batch()
        elif kind == "fp16":     # ZeRO-1's fp16 is DeepSpeed's optimizer, which an accelerator without fp16 refuses
            cfg = config("1f1b", 8, 1)
            cfg["fp16"] = {"enabled": True}
            cfg["zero_optimization"] = {"stage": 1}
            # DeepSpeed's CPU accelerator reports fp16 where the CPU has it (oneDNN fp16: AVX512-FP16/AMX); the
            # refusal is tested on the report of a CPU without it, on any host
            from deepspeed.accelerator import get_accelerator
            accelerator = get_accelerator()
            accelerator.is_fp16_supported = lambda: False
            try:
                make_engine(4, cfg, specs)
            finally:
                del accelerator.is_fp16_supported
        elif kind == "load-other-schedule":
            holder = [tempfile.mkdtemp(prefix="dsc_ckpt_") if tdist.get_rank() == 0 else None]
            tdist.broadcast_object_list(holder, src=0)
            a = make_engine(4, config("chimera", 8, 1), specs)
            a.save_checkpoint(holder[0], tag="t")
            b = make_engine(4, config("1f1b", 8, 1), specs)
            try:
                b.load_checkpoint(holder[0])
            finally:
                tdist.barrier()
                if tdist.get_rank() == 0:
                    shutil.rmtree(holder[0], ignore_errors=True)
        elif kind == "async-tied":
            make_engine(4, config("pipeoptim", 8, 1), mlp_specs(16, tied=True))
        elif kind == "async-actckpt":
            make_engine(4, config("pipedream", 8, 1), specs, activation_checkpoint_interval=1)
        elif kind == "async-bf16":
            cfg = config("spectrain", 4, 2)
            cfg["bf16"] = {"enabled": True}
            make_engine(2, cfg, specs)
        elif kind == "async-steps-ahead":
            make_engine(4, config("pipeoptim", 8, 1, steps_ahead="later"), specs)
        elif kind == "zero1-reduce":
            make_engine(4, config("breadth-first", 8, 1, zero1_reduce="later"), specs)
        elif kind == "zero2":
            cfg = config("chimera", 8, 1)
            cfg["zero_optimization"] = {"stage": 2}
            make_engine(4, cfg, specs)
        elif kind == "zero3-async":
            cfg = config("pipeoptim", 8, 1)
            cfg["zero_optimization"] = {"stage": 3}
            make_engine(4, cfg, specs)
        elif kind == "zero3-bf16":
            cfg = config("breadth-first", 8, 1)
            cfg.update(zero_optimization={"stage": 3}, bf16={"enabled": True})
            make_engine(4, cfg, specs)
        elif kind == "zero3-tied":
            cfg = config("zbv", 8, 1)
            cfg["zero_optimization"] = {"stage": 3}
            make_engine(4, cfg, mlp_specs(16, tied=True))
        elif kind == "zero3-groups":
            cfg = config("breadth-first", 8, 1, chunks=2)
            cfg["zero_optimization"] = {"stage": 3}
            net = PipelineModule(layers=specs, num_stages=4, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
            deepspeed.initialize(model=net, config=cfg, model_parameters=weight_decay_groups(net),
                                 optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
        elif kind == "groups-left-out":
            net = PipelineModule(layers=specs, num_stages=4, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
            deepspeed.initialize(model=net, config=config("chimera", 8, 1), model_parameters=weight_decay_groups(net)[:1],
                                 optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
        elif kind == "batch-size-interleaved":
            make_engine(4, config("interleaved", 8, 1, chunks=2), specs).set_train_batch_size(6 * MICRO)
        elif kind == "batch-size-async":
            make_engine(4, config("pipedream", 8, 1), specs).set_train_batch_size(4 * MICRO)
        elif kind == "eval-reduce":
            make_engine(4, config("chimera", 8, 1), specs).eval_batch(iter([]), reduce_output="sum")
        elif kind == "reshard-zero1":
            cfg = config("breadth-first", 8, 1, reshard_after_forward=False)
            make_engine(4, cfg, specs)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def load_other_precision():
    """A bf16 run's checkpoint loaded by an fp32 run, and an fp32 run's by a bf16 run: the optimizer state is
    refused by name on every rank (the masters and their state are another precision's), the weights alone load,
    as saved, and the bf16 run steps from them."""
    specs = mlp_specs(16)
    holder = [tempfile.mkdtemp(prefix="dsc_ckpt_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    cfg = config("chimera", 8, 1)
    cfg["bf16"] = {"enabled": True}
    saved = make_engine(4, cfg, specs)
    saved.train_batch(iter([(x.bfloat16(), y.bfloat16()) for x, y in my_batches(saved, make_global_batches(8), 0, 8)]))
    saved.save_checkpoint(holder[0], tag="t")
    loader = make_engine(4, config("chimera", 8, 1), specs)
    try:
        loader.load_checkpoint(holder[0])
        error = None
    except ValueError as exc:
        error = str(exc)
    loader.load_checkpoint(holder[0], load_optimizer_states=False, load_lr_scheduler_states=False)
    worst, _ = engine_diff(saved, loader)
    dtypes = sorted({str(p.dtype) for m in local_layers(loader).values() if isinstance(m, torch.nn.Module)
                     for p in m.parameters()})
    # and back: the fp32 run trains on and saves; a bf16 run loads its weights only and steps from them (its
    # optimizer's fp32 masters must follow the loaded weights, or the step would write the initial ones back)
    for step in range(3):
        loader.train_batch(iter(my_batches(loader, make_global_batches(8), step, 8)))
    loader.save_checkpoint(holder[0], tag="u")
    back, initial = make_engine(4, cfg, specs), make_engine(4, cfg, specs)      # initial: the same seeds, untrained
    try:
        back.load_checkpoint(holder[0], tag="u")
        back_error = None
    except ValueError as exc:
        back_error = str(exc)
    back.load_checkpoint(holder[0], tag="u", load_optimizer_states=False, load_lr_scheduler_states=False)
    back.train_batch(iter([(x.bfloat16(), y.bfloat16()) for x, y in my_batches(back, make_global_batches(8), 3, 8)]))
    to_saved, _ = engine_diff(back, loader)
    to_initial, _ = engine_diff(back, initial)
    tdist.barrier()
    if tdist.get_rank() == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
    return {"error": error, "weights_only_diff": worst, "loaded_dtypes": dtypes, "back_error": back_error,
            "back_step_from_saved": to_saved, "back_step_from_initial": to_initial}


def inplace_specs():
    """DeepSpeed's CIFAR AlexNet test model, scaled down: convolutions, in-place ReLUs, a lambda; every
    stage of a uniform cut into 4 or 8 has parameters."""
    from deepspeed.pipe import LayerSpec
    nn = torch.nn
    convs = [LayerSpec(nn.Conv2d, 3 if i == 0 else 4, 4, 3, padding=1) for i in range(7)]
    return [x for conv in convs for x in (conv, LayerSpec(nn.ReLU, inplace=True))] + \
        [lambda x: x.flatten(1), LayerSpec(nn.Linear, 4 * 8 * 8, 10)]


def inplace_checkpointing(schedules: dict, n=8, steps=2):
    """activation_checkpoint_interval=1 on a model with in-place ReLUs (DeepSpeed's AlexNet test): each
    schedule trains exactly as DeepSpeed's stock engine on the same script (its losses)."""
    def batches(step):
        g = torch.Generator().manual_seed(300 + step)
        return [(torch.randn(MICRO, 3, 8, 8, generator=g), torch.randint(0, 10, (MICRO,), generator=g))
                for _ in range(n)]

    def run(name, options):
        # uniform: DeepSpeed 0.19.8's "parameters" cut gives numpy layer offsets, which its seed_layers
        # hands to random.seed (a TypeError on Python 3.11 with numpy 2)
        net = PipelineModule(layers=inplace_specs(), num_stages=4, loss_fn=torch.nn.CrossEntropyLoss(),
                             partition_method="uniform", seed_layers=True, base_seed=BASE_SEED,
                             activation_checkpoint_interval=1)
        engine, _, _, _ = deepspeed.initialize(model=net, config=config(name, n, 1, clip=0.0, **options),
                                               optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))
        return [engine.train_batch(iter(batches(s))).item() for s in range(steps)]
    return {"stock": run(None, {}), **{name: run(name, options) for name, options in schedules.items()}}


def monitor_events(schedules, n=8, steps=3):
    """DeepSpeed's csv_monitor (the path TensorBoard, W&B and Comet share) under the stock engine and each
    schedule, same script: every event file, with its steps and values, read back on rank 0."""
    specs, global_batches = mlp_specs(16), make_global_batches(n)
    holder = [tempfile.mkdtemp(prefix="dsc_monitor_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    out = {}
    for name in ["stock", *schedules]:
        cfg = config(None if name == "stock" else name, n, 1, clip=0.0)
        cfg["csv_monitor"] = {"enabled": True, "output_path": holder[0], "job_name": name}
        engine = make_engine(4, cfg, specs)
        for s in range(steps):
            engine.train_batch(iter(my_batches(engine, global_batches, s, n)))
        engine.eval_batch(iter(my_batches(engine, global_batches, steps, n)))
        tdist.barrier()
        if tdist.get_rank() == 0:
            folder = os.path.join(holder[0], name)
            out[name] = {f: open(os.path.join(folder, f)).read().split() for f in sorted(os.listdir(folder))}
    tdist.barrier()
    if tdist.get_rank() == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
    return out


def weight_decay_groups(net):
    """A language-model script's groups: decay on weights, none (and another lr) on biases."""
    return [{"params": [p for p in net.parameters() if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in net.parameters() if p.dim() == 1], "weight_decay": 0.0, "lr": 0.02}]


def all_layer_params(engine) -> dict:
    """{layer index: [parameters]} of the engine's layers over every rank (a copy on every rank)."""
    return _gathered({idx: [p.detach().float().cpu().clone() for p in obj.parameters()]
                      for idx, obj in local_layers(engine).items() if isinstance(obj, torch.nn.Module)})


def _gathered(mine: dict):
    everyone = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, mine)
    merged = {}
    for part in everyone:
        merged.update(part)
    return merged


def parameter_groups(schedules: dict, n=8, steps=3, zero=0, dp=1, hows=("groups", "instance", "one-named-group")):
    """model_parameters as parameter groups (and an optimizer instance holding them): the weights after a
    few AdamW steps under each schedule against the stock engine's, same script (the stock pipeline
    engine refuses ZeRO-2/3: it runs ZeRO-1 there)."""
    specs, global_batches = mlp_specs(16), make_global_batches(n * dp)
    stages = 4 // dp

    def run(name, options, how):
        cfg = config(name, n, dp, clip=0.0, **options)
        if zero:
            cfg["zero_optimization"] = {"stage": zero if name else min(zero, 1)}
            cfg["zero_allow_untested_optimizer"] = True
        net = PipelineModule(layers=specs, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                             seed_layers=True, base_seed=BASE_SEED)
        if how == "groups":
            kwargs = dict(model_parameters=weight_decay_groups(net), optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
        elif how == "instance":
            kwargs = dict(optimizer=torch.optim.AdamW(weight_decay_groups(net), lr=LR))
        else:                               # DeepSpeed's checkpoint tests: one named group holding everything
            kwargs = dict(model_parameters=[{"params": list(net.parameters()), "name": "all"}],
                          optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
        engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, **kwargs)
        losses = [engine.train_batch(iter(my_batches(engine, global_batches, s, n))).item() for s in range(steps)]
        groups = [sorted((k, v) for k, v in g.items() if k in ("lr", "weight_decay", "name"))
                  for g in engine.optimizer.param_groups]
        if getattr(engine, "host", None) is not None and engine.host.shards is not None:
            with engine.gathered_weights():        # ZeRO-3 released the full weights
                return all_layer_params(engine), losses, groups
        return all_layer_params(engine), losses, groups

    out = {}
    for how in hows:
        stock, stock_losses, _ = run(None, {}, how)
        for name, options in schedules.items():
            mine, losses, groups = run(name, options, how)
            if tdist.get_rank() == 0:
                worst = max((a - b).abs().max().item() for idx in stock for a, b in zip(stock[idx], mine[idx]))
                out[f"{name}/{how}"] = {"max_param_diff": worst, "layers": sorted(mine) == sorted(stock),
                                        "tensors": sum(len(v) for v in mine.values()),
                                        "losses": losses, "stock_losses": stock_losses, "groups": groups}
    return out


def _plain(value):
    """Tensors (in tuples and lists) as nested lists, for the JSON results; None stays None."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def eval_arguments(schedules: dict, n=8):
    """eval_batch with each argument the stock engine takes, after one training step: every rank's return
    value under each schedule and the stock engine (the stock engine fails on reduce_output=None with
    bcast_loss, so that case runs under the schedules only)."""
    specs, global_batches = mlp_specs(16), make_global_batches(n)
    out = {}
    for name, options in {"stock": {}, **schedules}.items():
        engine = make_engine(4, config(None if name == "stock" else name, n, 1, clip=0.0, **options), specs)
        engine.train_batch(iter(my_batches(engine, global_batches, 0, n)))
        data = my_batches(engine, global_batches, 1, n)
        if name == "stock":
            # DeepSpeed 0.19.8 adds eval outputs into its training loss total (reset at the start of
            # train_batch only), so compute_loss=False fails after any step there: reset it for the stock run
            engine.total_loss = None
        mine = {"outputs": engine.eval_batch(iter(data), compute_loss=False),
                "logits": engine.eval_batch(iter(data), return_logits=True),
                "list": engine.eval_batch(iter(data), reduce_output=None, bcast_loss=False),
                "half": engine.eval_batch(iter(data), num_micro_batches=n // 2),
                "default": engine.eval_batch(iter(data))}
        if name != "stock":
            mine["list-bcast"] = engine.eval_batch(iter(data), reduce_output=None)
        out[name] = _gathered({tdist.get_rank(): {k: _plain(v) for k, v in mine.items()}})
    return out


def batch_size_change(schedules: dict, sizes=(8, 4, 16)):
    """set_train_batch_size between steps (8, then 4, then 16 micro-batches): losses and weights against
    the stock engine's on the same script."""
    specs = mlp_specs(16)
    out = {}
    for name, options in {"stock": {}, **schedules}.items():
        engine = make_engine(4, config(None if name == "stock" else name, sizes[0], 1, clip=0.0, **options), specs)
        losses, counts = [], []
        for step, n in enumerate(sizes):
            if n != engine.micro_batches:
                engine.set_train_batch_size(n * MICRO)
            counts.append(engine.micro_batches)
            losses.append(engine.train_batch(iter(make_global_batches(n)(step))).item())
        out[name] = {"losses": losses, "micro_batches": counts, "params": all_layer_params(engine)}
    if tdist.get_rank() != 0:
        return {}
    stock = out.pop("stock")
    return {name: {"losses": r["losses"], "stock_losses": stock["losses"], "micro_batches": r["micro_batches"],
                   "max_param_diff": max((a - b).abs().max().item() for idx in stock["params"]
                                         for a, b in zip(stock["params"][idx], r["params"][idx])),
                   "tensors": sum(len(v) for v in r["params"].values())}
            for name, r in out.items()}


def bf16_export(schedule, stages, dp, n, steps=2):
    """The HF export's layer states under bf16: the optimizer's fp32 masters (what was trained), gathered
    over data parallelism, not the modules' bf16 copies; rounded to bf16 they are those copies."""
    from ds_chimera.hf.export import gather_layer_states
    cfg = config(schedule, n, dp, clip=0.0)
    cfg["bf16"] = {"enabled": True}
    engine = make_engine(stages, cfg, mlp_specs(16))
    global_batches = make_global_batches(n * dp)
    for s in range(steps):
        engine.train_batch(iter([(x.bfloat16(), y.bfloat16()) for x, y in my_batches(engine, global_batches, s, n)]))
    exported = gather_layer_states(engine, dst=0)
    modules = all_layer_params(engine)
    if tdist.get_rank() != 0:
        return {}
    dtypes = sorted({str(v.dtype) for state in exported.values() for v in state.values()})
    finer = rounding = 0
    for idx, state in exported.items():
        for value, module_copy in zip(state.values(), modules[idx]):
            rounding = max(rounding, (value.bfloat16().float() - module_copy).abs().max().item())
            finer += int((value.bfloat16().float() != value).any())
    return {"dtypes": dtypes, "layers": sorted(exported) == sorted(modules), "tensors_finer_than_bf16": finer,
            "tensors": sum(len(v) for v in exported.values()), "max_rounding_diff": rounding}


def lm_training(schedule, steps=25, **options):
    """The DynamicConv LM of ds_chimera.nn through a pipeline schedule: the loss must fall."""
    from ds_chimera.nn import counting_batches, lm_layer_specs, lm_loss
    specs = lm_layer_specs(vocab_size=32, d_model=32, num_layers=6, kernel_sizes=(3, 7, 15, 31), num_heads=4,
                           max_len=16)
    net = PipelineModule(layers=specs, num_stages=4, loss_fn=lm_loss, partition_method="uniform",
                         seed_layers=True, base_seed=BASE_SEED)
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "gradient_clipping": 1.0, "pipeline": {"schedule": schedule, "timeout": 60, **options}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg,
                                           optimizer=lambda p: torch.optim.AdamW(p, lr=5e-3))
    data = counting_batches(2, seq_len=16, vocab_size=32, seed=7)
    return {"losses": [engine.train_batch(data).item() for _ in range(steps)]}


def config_file_training(path, steps=6):
    """A shipped configs/*.json, unchanged but for test timeouts: its schedule trains the DynamicConv LM,
    against the same model, optimizer (read back from the engine) and data in one process: plain
    training for a synchronous schedule, LocalPipeline for an asynchronous one."""
    from ds_chimera.nn import counting_batches, lm_layer_specs, lm_loss
    from ds_chimera.runtime.local import LocalPipeline
    with open(path) as fh:
        cfg = json.load(fh)
    cfg["steps_per_print"] = 1000
    cfg["pipeline"]["timeout"] = 60
    # the shipped batch keys are "auto" (HF fills them); a DeepSpeed script sets one, the rest are derived
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=8)
    specs = lm_layer_specs(vocab_size=32, d_model=32, num_layers=6, kernel_sizes=(3, 7, 15, 31), num_heads=4,
                           max_len=16)
    net = PipelineModule(layers=specs, num_stages=4, loss_fn=lm_loss, partition_method="uniform",
                         seed_layers=True, base_seed=BASE_SEED)
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
    micro = engine.train_micro_batch_size_per_gpu()
    data = counting_batches(micro, seq_len=16, vocab_size=32, seed=7)
    losses = [engine.train_batch(data).item() for _ in range(steps)]
    # the reference: the optimizer's hyperparameters as the engine built them
    group = {k: v for k, v in engine.optimizer.param_groups[0].items() if k != "params"}
    make_opt = lambda params: type(engine.optimizer)(params, **{k: group[k] for k in  # noqa: E731
                                                                ("lr", "betas", "eps", "weight_decay", "amsgrad")})
    layers = build_reference(specs)
    ref_data = counting_batches(micro, seq_len=16, vocab_size=32, seed=7)
    n, clip = engine.micro_batches, float(cfg.get("gradient_clipping", 0.0))
    ref_losses = []
    if engine.schedule.synchronous:
        params = reference_params(layers)
        opt = make_opt(params)
        for _ in range(steps):
            opt.zero_grad()
            total = 0.0
            for _ in range(n):
                x, y = next(ref_data)
                loss = lm_loss(_forward_grad(layers, x), y) / n
                loss.backward()
                total += loss.item()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            ref_losses.append(total)
    else:
        from ds_chimera.schedules import registry
        parts = engine.plan.parts
        stages = [torch.nn.Sequential(*layers[parts[k]:parts[k + 1]]) for k in range(4)]
        options = dict(engine.schedule.config)
        local = LocalPipeline(registry.build(engine.schedule.name, 4, n, **options), stages,
                              [make_opt(m.parameters()) for m in stages], lm_loss, clip=clip)
        ref_losses = [local.train_batch([next(ref_data) for _ in range(n)]) for _ in range(steps)]
    return {"schedule": engine.schedule.name, "options": dict(engine.schedule.config), "losses": losses,
            "ref_losses": ref_losses, "micro_batches": engine.micro_batches,
            "optimizer": type(engine.optimizer).__name__}


def _forward_grad(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def traced_step(schedule, n=8, **options):
    """One step with trace_dir: every rank writes what it ran, in the simulator's trace format."""
    holder = [tempfile.mkdtemp(prefix="dsc_trace_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    cfg = config(schedule, n, 1, **options)
    cfg["pipeline"]["trace_dir"] = holder[0]
    engine = make_engine(4, cfg, mlp_specs(16))
    engine.train_batch(iter(make_global_batches(n)(0)))
    tdist.barrier()
    out = {}
    if tdist.get_rank() == 0:
        for name in sorted(os.listdir(holder[0])):
            events = json.load(open(os.path.join(holder[0], name)))["traceEvents"]
            out[name] = sorted(e["name"][0] for e in events if e.get("ph") == "X")
        shutil.rmtree(holder[0], ignore_errors=True)
    return {"files": out}


def async_engine(schedule, stages, dp, n, specs, optimizer, clip=0.0, bf16=False, **options):
    net = PipelineModule(layers=specs, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         seed_layers=True, base_seed=BASE_SEED)
    cfg = config(schedule, n, dp, clip, **options)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, optimizer=optimizer)
    return engine


def async_model(schedule, stage_modules, clip, **options):
    """The independent model of the method (tests/distributed/async_reference.py), on ``stage_modules``."""
    from async_reference import SGD, AsyncReference
    return AsyncReference(schedule, stage_modules, lambda: SGD(LR, momentum=0.9), clip=clip,
                          steps_ahead=options.get("steps_ahead", "paper"),
                          predictor="last-update" if options.get("predictor") == "last-update" else "optimizer",
                          smoothing=options.get("smoothing", 0.9), update_interval=options.get("update_interval"))


def async_versus_local(schedule, stages, dp, n, calls=2, bf16=False, clip=NO_CLIP, **options):
    """The asynchronous engine against the independent model of its method (async_reference) and against
    LocalPipeline (one process, fp32), on the same global mini-batches. Unclipped by default (NO_CLIP: each
    stage's norm is computed, never applied), so that a wrong gradient scale moves the weights."""
    from async_reference import versions_held
    from ds_chimera.runtime.local import LocalPipeline
    from ds_chimera.schedules import registry
    specs = mlp_specs(16)
    make_opt = lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9)  # noqa: E731
    engine = async_engine(schedule, stages, dp, n, specs, make_opt, clip=clip, bf16=bf16, **options)
    global_batches = make_global_batches(n * dp)
    cast = (lambda b: [(x.bfloat16(), y.bfloat16()) for x, y in b]) if bf16 else (lambda b: b)
    losses, norms = [], []
    for s in range(calls):
        losses.append(engine.train_batch(iter(cast(my_batches(engine, global_batches, s, n)))).item())
        norm = engine.get_global_grad_norm()          # this rank's stage, its call's last update
        norms.append(None if norm is None else float(norm))
    parts = engine.plan.parts
    # data-parallel replicas' micro-batch i together make mini-batch i
    mini_batches = [[(torch.cat([b[d * n + i][0] for d in range(dp)]), torch.cat([b[d * n + i][1] for d in range(dp)]))
                     for i in range(n)] for b in map(global_batches, range(calls))]
    ref_layers = build_reference(specs)
    stage_modules = [torch.nn.Sequential(*ref_layers[parts[k]:parts[k + 1]]) for k in range(stages)]
    local = LocalPipeline(registry.build(schedule, stages, n, **options), stage_modules,
                          [make_opt(m.parameters()) for m in stage_modules], torch.nn.functional.mse_loss, clip=clip)
    ref_losses = [local.train_batch(batches) for batches in mini_batches]
    model_layers = build_reference(specs)
    model = async_model(schedule, [torch.nn.Sequential(*model_layers[parts[k]:parts[k + 1]]) for k in range(stages)],
                        clip, **options)
    model_losses = [model.train_call(batches) for batches in mini_batches]
    held = torch.tensor([engine.weight_versions_held()])
    gathered = [torch.zeros_like(held) for _ in range(tdist.get_world_size())]
    tdist.all_gather(gathered, held)
    stage, counted = engine.grid.get_stage_id(), {}
    updates = len(model.norms[stage]) // calls          # per call
    return {"max_param_diff": max_param_diff(engine, ref_layers), "losses": losses, "ref_losses": ref_losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "model_param_diff": max_param_diff(engine, model_layers, counted),
            "compared_tensors": counted["tensors"],
            "reference_tensors": sum(1 for layer in model_layers for _ in layer.parameters()),
            "model_losses": model_losses, "model_loss_diff": max(abs(a - b) for a, b in zip(losses, model_losses)),
            "norms": norms, "model_norms": [model.norms[stage][(c + 1) * updates - 1] for c in range(calls)],
            "clip": clip, "updates_clipped": sum(x > clip for per_stage in model.norms for x in per_stage),
            "updates": sum(map(len, model.norms)),
            "model_versions_held": versions_held(schedule, stages, n, options.get("update_interval"),
                                                 options.get("steps_ahead", "paper")),
            "versions_held": [int(g) for g in gathered], "stage_of_rank": [stage],
            "global_steps": engine.global_steps}


def async_probe(schedule, n=8, calls=3, bf16=False, **options):
    """Instrumented run: the weight version every forward and backward sees, on every rank."""
    from deepspeed.pipe import LayerSpec
    from probes import LOG, VersionProbe
    LOG.clear()
    if schedule == "spectrain":
        options.setdefault("smoothing", 0.0)     # plain SGD probes: see PROBE_SPECTRAIN in test_pipeoptim
    specs = [LayerSpec(VersionProbe) for _ in range(4)]
    engine = async_engine(schedule, 4, 1, n, specs, lambda p: torch.optim.SGD(p, lr=1.0), bf16=bf16, **options)
    batches = make_global_batches(n)
    cast = (lambda b: [(x.bfloat16(), y.bfloat16()) for x, y in b]) if bf16 else (lambda b: b)
    for s in range(calls):
        engine.train_batch(iter(cast(batches(s))))
    gathered = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, [list(e) for e in LOG])
    return {"log": [e for part in gathered for e in part], "calls": calls, "n": n}


def async_continuous(schedule, n=8, calls=2, clip=NO_CLIP, **options):
    """fill='continuous': calls that keep the pipeline full, then drain(), against one call over the same
    mini-batches (a plain asynchronous 1F1B of calls*N + D-1 mini-batches) of the independent model
    (async_reference) and of LocalPipeline."""
    from ds_chimera.runtime.local import LocalPipeline
    from ds_chimera.schedules import registry
    specs, stages = mlp_specs(16), 4
    total = calls * n + stages - 1
    make_opt = lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9)  # noqa: E731
    engine = async_engine(schedule, stages, 1, n, specs, make_opt, clip=clip, fill="continuous", **options)
    data = make_global_batches(total)(0)
    stream = iter(data)
    losses = [engine.train_batch(stream).item() for _ in range(calls)]
    drained = engine.drain()
    ref_layers = build_reference(specs)
    parts = engine.plan.parts
    modules = [torch.nn.Sequential(*ref_layers[parts[k]:parts[k + 1]]) for k in range(stages)]
    local = LocalPipeline(registry.build(schedule, stages, total, **options), modules,
                          [make_opt(m.parameters()) for m in modules], torch.nn.functional.mse_loss, clip=clip)
    ref_mean = local.train_batch(data)
    model_layers = build_reference(specs)
    model = async_model(schedule, [torch.nn.Sequential(*model_layers[parts[k]:parts[k + 1]]) for k in range(stages)],
                        clip, **options)
    model_mean = model.train_call(data)
    mean = (sum(losses) * n + drained * (stages - 1)) / total
    counted = {}
    return {"max_param_diff": max_param_diff(engine, ref_layers), "mean_loss": mean, "ref_mean_loss": ref_mean,
            "model_param_diff": max_param_diff(engine, model_layers, counted), "model_mean_loss": model_mean,
            "compared_tensors": counted["tensors"],
            "reference_tensors": sum(1 for layer in model_layers for _ in layer.parameters()),
            "global_steps": engine.global_steps, "total": total}


def unequal_specs():
    """Layers of unequal cost and size (a wide block, a heavy head), for the planner's scenario."""
    from torch import nn
    from deepspeed.pipe import LayerSpec
    from models import WIDTH
    return ([LayerSpec(nn.Linear, WIDTH, 64), LayerSpec(CountingTanh)] +
            [LayerSpec(nn.Linear, 64, 64) for _ in range(4)] + [LayerSpec(CountingTanh), LayerSpec(nn.Linear, 64, 256),
                                                                 LayerSpec(nn.Linear, 256, WIDTH)])


def engine_diff(first, second):
    """Largest difference between two engines' layers on the same ranks (same plan), all-reduced MAX."""
    a, b = local_layers(first), local_layers(second)
    if sorted(a) != sorted(b):
        raise AssertionError(f"the engines hold different layers: {sorted(a)} and {sorted(b)}")
    worst, tensors = 0.0, 0
    for idx in a:
        if isinstance(a[idx], torch.nn.Module):
            for p, q in zip(a[idx].parameters(), b[idx].parameters()):
                worst = max(worst, (p.detach() - q.detach()).abs().max().item())
                tensors += 1
    t = torch.tensor([worst, tensors], dtype=torch.float64)
    tdist.all_reduce(t[:1], op=tdist.ReduceOp.MAX)
    n = torch.tensor([tensors])
    tdist.all_reduce(n)
    return t[0].item(), int(n.item())


def auto_plan(stages=4, n=8, steps=2):
    """"schedule": "auto" with training_data: the plan every rank runs, and the weights against the same
    section named by hand (the plan_file it wrote) and against one-process training."""
    from torch.utils.data import TensorDataset
    from models import WIDTH
    specs = unequal_specs()
    plan_file = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "auto-plan.json")
    data = TensorDataset(torch.randn(4 * n * MICRO, WIDTH), torch.randn(4 * n * MICRO, WIDTH))

    def build(cfg, training_data=None):
        net = PipelineModule(layers=specs, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                             seed_layers=True, base_seed=BASE_SEED)
        engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, training_data=training_data,
                                               optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))
        return engine

    def train(engine):
        return [engine.train_batch(iter(global_batches(s))).item() for s in range(steps)]

    global_batches = make_global_batches(n)
    auto = build(config("auto", n, 1, clip=NO_CLIP, plan_file=plan_file, memory_limit_gb=64), data)
    plan = auto.plan
    chosen = {"schedule": plan.schedule.name, **plan.config.options, "parts": list(plan.parts)}
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, chosen)
    tdist.barrier()
    with open(plan_file) as fh:
        written = json.load(fh)["pipeline"]
    # a later start with that plan_file runs its section without profiling (no training_data needed)
    again = build(config("auto", n, 1, clip=NO_CLIP, plan_file=plan_file, memory_limit_gb=64)).plan
    rerun = {"schedule": again.schedule.name, **again.config.options, "parts": list(again.parts)}
    auto_losses = train(auto)
    named = build(config(written["schedule"], n, 1, clip=NO_CLIP,
                         **{k: v for k, v in written.items() if k != "schedule"}))
    named_losses = train(named)
    diff, tensors = engine_diff(auto, named)
    ref_layers = build_reference(specs)
    ref_losses, _ = run_reference(ref_layers, global_batches, steps, LR, NO_CLIP)
    return {"chosen": chosen, "every_rank": every, "written": written, "rerun": rerun, "auto_losses": auto_losses,
            "named_losses": named_losses, "engine_diff": diff, "compared_tensors": tensors,
            "ref_diff": max_param_diff(auto, ref_layers), "ref_losses": ref_losses}


SCENARIOS = {}
SCENARIOS["async-continuous-pipeoptim"] = lambda: async_continuous("pipeoptim")
SCENARIOS["async-continuous-pipedream"] = lambda: async_continuous("pipedream")
SCENARIOS["async-continuous-spectrain-code"] = lambda: async_continuous("spectrain", steps_ahead="code")
ASYNC_CLIP = 0.3
ASYNC = {"pipedream": {}, "pipedream-2bw": {}, "pipeoptim": {}, "spectrain": {},
         "pipeoptim-code": {"steps_ahead": "code"}, "pipeoptim-last": {"predictor": "last-update"}}
for key, opts in ASYNC.items():
    name = "pipeoptim" if key.startswith("pipeoptim") else key
    SCENARIOS[f"async-4x1-{key}"] = (lambda name=name, opts=opts: async_versus_local(name, 4, 1, 8, **opts))
    SCENARIOS[f"async-2x2-{key}"] = (lambda name=name, opts=opts: async_versus_local(name, 2, 2, 4, **opts))
    SCENARIOS[f"async-probe-{key}"] = (lambda name=name, opts=opts: async_probe(name, **opts))
# bf16 through DeepSpeed's BF16_Optimizer: predictions from the fp32 master weights and state
SCENARIOS["async-bf16-4x1-pipeoptim"] = lambda: async_versus_local("pipeoptim", 4, 1, 8, bf16=True)
SCENARIOS["async-bf16-4x1-spectrain"] = lambda: async_versus_local("spectrain", 4, 1, 8, bf16=True)
SCENARIOS["async-bf16-2x2-pipedream"] = lambda: async_versus_local("pipedream", 2, 2, 4, bf16=True)
# per-stage clipping (each stage's own norm), active on some updates and not on others
SCENARIOS["async-clipped-4x1-pipeoptim"] = lambda: async_versus_local("pipeoptim", 4, 1, 8, clip=ASYNC_CLIP)
SCENARIOS["async-clipped-2x2-pipedream"] = lambda: async_versus_local("pipedream", 2, 2, 4, clip=ASYNC_CLIP)
SCENARIOS["async-bf16-probe-pipeoptim"] = lambda: async_probe("pipeoptim", bf16=True)
SCENARIOS["async-bf16-probe-pipedream-2bw"] = lambda: async_probe("pipedream-2bw", bf16=True)
SCENARIOS["async-ckpt-resume-pipeoptim"] = lambda: checkpoint_resume("pipeoptim", 4, 1, 8, predictor="last-update")
SCENARIOS["async-ckpt-resume-2x2-pipedream"] = lambda: checkpoint_resume("pipedream", 2, 2, 4)
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved": {"chunks": 2}, "breadth-first": {"chunks": 2},
             "chimera": {}, "chimera-fd": {"order": "forward-doubling"}, "chimera-merged": {"order": "merged"},
             "chimera-concat": {"order": "concat"}, "chimera-zb": {"order": "zero-bubble"},
             "zb-h1": {}, "zbv": {}, "dualpipev": {}}
# Every schedule unclipped (gradient scale and the global norm checked), on both grids.
for key, opts in SCHEDULES.items():
    name = key.split("-")[0] if key.startswith("chimera") else key
    SCENARIOS[f"equiv-4x1-{key}"] = (lambda name=name, opts=opts: train_and_compare(name, 4, 1, 8, clip=NO_CLIP,
                                                                                     **opts))
    SCENARIOS[f"equiv-2x2-{key}"] = (lambda name=name, opts=opts: train_and_compare(name, 2, 2, 4, clip=NO_CLIP,
                                                                                     **opts))
# four pipelines on four ranks (stages/2 = 1 on the 2 x 2 grid, so 4 x 1 only)
SCENARIOS["equiv-4x1-chimera-zb-f2"] = lambda: train_and_compare("chimera", 4, 1, 8, clip=NO_CLIP, order="zero-bubble",
                                                                 pipelines=2)
# ... and clipped on the true global norm (replicas and data-parallel copies counted once)
SCENARIOS["clipped-4x1-chimera"] = lambda: train_and_compare("chimera", 4, 1, 8)
SCENARIOS["clipped-2x2-chimera"] = lambda: train_and_compare("chimera", 2, 2, 4)
SCENARIOS["clipped-4x1-interleaved"] = lambda: train_and_compare("interleaved", 4, 1, 8, chunks=2)
# the variants, unclipped too
SCENARIOS["unclipped-tied-4x1-chimera"] = lambda: train_and_compare("chimera", 4, 1, 8, tied=True, clip=NO_CLIP)
SCENARIOS["unclipped-zero1-2x2-breadth-first"] = lambda: train_and_compare("breadth-first", 2, 2, 4, zero=1, chunks=2,
                                                                           clip=NO_CLIP)
SCENARIOS["unclipped-actckpt-4x1-chimera"] = lambda: train_and_compare("chimera", 4, 1, 8, aci=2, clip=NO_CLIP)


def program_file_training():
    """"pipeline": {"program": FILE}: a program written to a file (as another solver would) trains exactly."""
    from ds_chimera.schedules import build
    holder = [tempfile.mkdtemp(prefix="dsc_program_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    path = os.path.join(holder[0], "chimera-zb.program")
    if tdist.get_rank() == 0:
        build("chimera", 4, 8, order="zero-bubble").lower().dump(path)
    tdist.barrier()
    try:
        result = train_and_compare("program", 4, 1, 8, clip=NO_CLIP, program=path)
    finally:
        tdist.barrier()
        if tdist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)
    return result


SCENARIOS["program-4x1-chimera-zb"] = program_file_training
SCENARIOS["tied-4x1-chimera"] = lambda: train_and_compare("chimera", 4, 1, 8, tied=True)
SCENARIOS["tied-4x1-1f1b"] = lambda: train_and_compare("1f1b", 4, 1, 8, tied=True)
SCENARIOS["tied-2x2-zbv"] = lambda: train_and_compare("zbv", 2, 2, 4, tied=True)
SCENARIOS["actckpt-4x1-chimera"] = lambda: train_and_compare("chimera", 4, 1, 8, aci=2)
SCENARIOS["actckpt-4x1-zb-h1"] = lambda: train_and_compare("zb-h1", 4, 1, 8, aci=1)
SCENARIOS["actckpt-4x1-chimera-zb"] = lambda: train_and_compare("chimera", 4, 1, 8, aci=1, order="zero-bubble")
SCENARIOS["actckpt-4x1-interleaved"] = lambda: train_and_compare("interleaved", 4, 1, 8, aci=2, chunks=2)
SCENARIOS["ckpt-resume-chimera"] = lambda: checkpoint_resume("chimera", 4, 1, 8)
SCENARIOS["ckpt-resume-2x2-zbv"] = lambda: checkpoint_resume("zbv", 2, 2, 4)
SCENARIOS["ckpt-cross-chimera-to-1f1b"] = lambda: checkpoint_resume("chimera", 4, 1, 8, load_schedule="1f1b")
SCENARIOS["ckpt-cross-chimera-to-stock"] = lambda: checkpoint_resume("chimera", 4, 1, 8, load_schedule="stock")
SCENARIOS["ckpt-cross-zbv-to-interleaved"] = lambda: checkpoint_resume("zbv", 4, 1, 8, load_schedule="interleaved")
SCENARIOS["stock-clipping"] = stock_clipping
# ZeRO-2/3 (sharded chunks): 2 stages x 2 data-parallel for every single-route synchronous schedule
for key, opts in {"gpipe": {}, "1f1b": {}, "interleaved": {"chunks": 2}, "breadth-first": {"chunks": 2},
                  "zb-h1": {}, "zbv": {}, "dualpipev": {}}.items():
    for zero in (2, 3):
        SCENARIOS[f"zero{zero}-2x2-{key}"] = (lambda key=key, opts=opts, zero=zero:
                                              zero_compare(key, 2, 2, 4, zero, **opts))
SCENARIOS["zero3-4x1-breadth-first"] = lambda: zero_compare("breadth-first", 4, 1, 8, 3, chunks=2)
SCENARIOS["zero3-4x1-zbv"] = lambda: zero_compare("zbv", 4, 1, 8, 3)
SCENARIOS["zero3-2x2-breadth-first-keep"] = lambda: zero_compare("breadth-first", 2, 2, 4, 3, chunks=2,
                                                                 reshard_after_forward=False)
SCENARIOS["zero3-ckpt-breadth-first"] = lambda: zero_checkpoint("breadth-first", 3, chunks=2)
SCENARIOS["interop-stock-to-1f1b"] = lambda: stock_interop("stock", "1f1b")
SCENARIOS["interop-1f1b-to-stock"] = lambda: stock_interop("1f1b", "stock")
SCENARIOS["interop-stock-to-gpipe"] = lambda: stock_interop("stock", "gpipe")
SCENARIOS["trace-chimera"] = lambda: traced_step("chimera", order="concat")     # a fused backward: B
SCENARIOS["trace-zbv"] = lambda: traced_step("zbv")
SCENARIOS["lm-chimera"] = lambda: lm_training("chimera")
SCENARIOS["lm-zbv"] = lambda: lm_training("zbv")
SCENARIOS["param-groups"] = lambda: parameter_groups(
    {"1f1b": {}, "chimera": {}, "interleaved": {"chunks": 2}, "zbv": {}}, hows=("groups",))
SCENARIOS["param-groups-forms"] = lambda: parameter_groups({"chimera": {}}, hows=("instance", "one-named-group"))
SCENARIOS["param-groups-zero1-2x2"] = lambda: parameter_groups({"breadth-first": {"chunks": 2}}, n=4, zero=1, dp=2,
                                                                hows=("groups",))
SCENARIOS["param-groups-zero3-2x2"] = lambda: parameter_groups({"breadth-first": {"chunks": 2}}, n=4, zero=3, dp=2,
                                                                hows=("one-named-group",))
SCENARIOS["eval-arguments"] = lambda: eval_arguments({"1f1b": {}, "chimera": {}, "zbv": {}})
SCENARIOS["batch-size-change"] = lambda: batch_size_change({"1f1b": {}, "chimera": {}, "interleaved": {"chunks": 2},
                                                            "zbv": {}})
SCENARIOS["bf16-export-2x2-zbv"] = lambda: bf16_export("zbv", 2, 2, 4)
SCENARIOS["monitors"] = lambda: monitor_events(["1f1b", "chimera", "zbv"])
SCENARIOS["inplace-actckpt"] = lambda: inplace_checkpointing(
    {"gpipe": {}, "1f1b": {}, "interleaved": {"chunks": 2}, "chimera": {}, "zb-h1": {}, "zbv": {}})
SCENARIOS["zero1-2x2-breadth-first"] = lambda: train_and_compare("breadth-first", 2, 2, 4, zero=1, chunks=2)
SCENARIOS["zero1-2x2-breadth-first-end"] = lambda: train_and_compare("breadth-first", 2, 2, 4, zero=1, chunks=2,
                                                                   zero1_reduce="end")
SCENARIOS["zero1-2x2-zbv-tied"] = lambda: train_and_compare("zbv", 2, 2, 4, zero=1, tied=True)
SCENARIOS["zero1-2x2-zbv"] = lambda: train_and_compare("zbv", 2, 2, 4, zero=1)
# a stage on two ranks of the pipeline (Chimera's replicas) and a weight tied across ranks: ZeRO-1's own norm
# counts each once (the copies are marked ds_pipe_replicated, as stock marks its tied copies)
SCENARIOS["zero1-4x1-chimera"] = lambda: train_and_compare("chimera", 4, 1, 8, zero=1)
SCENARIOS["zero1-2x2-chimera"] = lambda: train_and_compare("chimera", 2, 2, 4, zero=1)
SCENARIOS["zero1-4x1-1f1b-tied"] = lambda: train_and_compare("1f1b", 4, 1, 8, zero=1, tied=True)
SCENARIOS["zero1-4x1-chimera-tied"] = lambda: train_and_compare("chimera", 4, 1, 8, zero=1, tied=True)
SCENARIOS["bf16-4x1-chimera"] = lambda: train_and_compare("chimera", 4, 1, 8, bf16=True)
SCENARIOS["bf16-4x1-chimera-zb"] = lambda: train_and_compare("chimera", 4, 1, 8, bf16=True, order="zero-bubble")
SCENARIOS["bf16-2x2-zbv"] = lambda: train_and_compare("zbv", 2, 2, 4, bf16=True)
SCENARIOS["bf16-4x1-stock"] = lambda: train_and_compare(None, 4, 1, 8, bf16=True, clip=0.0)
SCENARIOS["bf16-4x1-1f1b-noclip"] = lambda: train_and_compare("1f1b", 4, 1, 8, bf16=True, clip=0.0)
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")
for _name in sorted(os.listdir(CONFIG_DIR)):
    if _name.endswith(".json"):
        SCENARIOS[f"config-{_name[:-5]}"] = (lambda path=os.path.join(CONFIG_DIR, _name): config_file_training(path))
# single-GPU smoke (D = 1; NCCL): every chunk of the schedule on one rank, same-rank hand-offs
for key, opts in {"1f1b": {}, "gpipe": {}, "interleaved": {"chunks": 2}, "breadth-first": {"chunks": 3},
                  "zb-h1": {}, "zbv": {}}.items():
    SCENARIOS[f"equiv-1x1-{key}"] = (lambda key=key, opts=opts: train_and_compare(key, 1, 1, 4, **opts))
    SCENARIOS[f"bf16-1x1-{key}"] = (lambda key=key, opts=opts: train_and_compare(key, 1, 1, 4, bf16=True, **opts))
SCENARIOS["auto-plan"] = auto_plan
for kind in ("unknown", "pipelines", "interleaved-n", "option", "zero2", "zero1-reduce",
             "zero3-async", "zero3-bf16", "zero3-tied", "reshard-zero1", "zero3-groups", "groups-left-out",
             "batch-size-interleaved", "batch-size-async", "eval-reduce", "auto-no-data", "stages",
             "fp16", "batch-split",
             "load-other-schedule", "async-tied", "async-actckpt", "async-bf16", "async-steps-ahead"):
    SCENARIOS[f"bad-{kind}"] = (lambda kind=kind: bad_config(kind))
SCENARIOS["load-other-precision"] = load_other_precision


def main():
    deepspeed.init_distributed(dist_backend=os.environ.get("DS_CHIMERA_TEST_BACKEND", "gloo"))
    run_scenarios(SCENARIOS, sys.argv[1], sys.argv[2].split(","))
    tdist.barrier()
    # A normal exit, teardown included: the library destroys the process groups at exit
    # (runtime/teardown.py) and stops the fault monitor's threads (FaultMonitor.close), which ended
    # the aborts this process once had in the interpreter's teardown ("terminate called without an
    # active exception").


if __name__ == "__main__":
    main()
