"""Tensor x pipeline (x data) parallelism on the scheduled engine, against DeepSpeed's stock engine and one process.

    torchrun --nproc_per_node 4 tensor_parallel_worker.py OUT          # T = 2, P = 2, D = 1
    torchrun --nproc_per_node 8 tensor_parallel_worker.py OUT --dp 2   # T = 2, P = 2, D = 2

A PipelineModule on a PipeModelDataParallelTopology of 8 tensor-parallel MLP blocks (column- then
row-parallel linears, ds_chimera/nn/tensor_parallel.py). Each case trains 3 steps; every rank's slices of
every layer are gathered and put back together, so each case yields whole weights, which rank 0 writes with
the losses and gradient norms. The reference is one process running the same blocks with tensor size 1.

Models: "sliced" has no bias in its row-parallel linears, so every parameter is a tensor slice and DeepSpeed's
own norm (which counts an unsliced parameter on its model-parallel rank 0 only, stage 0 of the pipeline) is the
true one; "biased" adds the row-parallel biases, which every tensor rank holds whole.
"""
import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as tdist
from torch import nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

import ds_chimera  # noqa: F401,E402  (installs the "pipeline" key)
from ds_chimera.nn.tensor_parallel import TensorGroup, TensorParallelMLP  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import deepspeed_loss_scaler, fp16_master_step  # noqa: E402

WIDTH, HIDDEN, LAYERS, N, MICRO, STEPS, LR, CLIP = 8, 16, 8, 8, 2, 3, 0.05, 0.05
SYNCHRONOUS = {"gpipe": {}, "1f1b": {}, "interleaved": {"chunks": 2}, "breadth-first": {"chunks": 2}, "chimera": {},
               "zb-h1": {}, "zbv": {}, "dualpipev": {}}


# CI's cases: every schedule clipped (the sliced model against stock, the biased one against one process); the
# unclipped stock comparison, ZeRO-1 and fp16 on some schedules. make test-full: all of them on every schedule.
CI_TIER = {"unclipped": ("1f1b", "zbv", "chimera"), "zero1": ("zbv", "chimera"), "fp16": (("chimera", 3),),
           "bf16": ("chimera",)}
FULL_TIER = {"unclipped": tuple(SYNCHRONOUS), "zero1": ("1f1b", "zbv", "interleaved", "chimera"),
             "fp16": (("1f1b", 1), ("zbv", 2), ("chimera", 3)),                          # a different rank each
             "bf16": ("1f1b", "zbv", "chimera")}


def batches(step: int, dp: int) -> list:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g))
            for _ in range(N * dp)]


def specs(tensor_group, biased: bool) -> list:
    return [LayerSpec(TensorParallelMLP, WIDTH, tensor_group, seed=i, hidden=HIDDEN, bias=biased)
            for i in range(LAYERS)]


def reference(biased: bool, clip: float, dp: int) -> dict:
    """One process, tensor size 1: the global batch (every data-parallel copy's micro-batches), mean loss."""
    torch.manual_seed(0)
    layers = [spec.build() for spec in specs(TensorGroup(), biased)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        micro = batches(step, dp)
        for x, y in micro:
            out = x
            for layer in layers:
                out = layer(out)
            loss = nn.functional.mse_loss(out, y)
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip else 1e9)))
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms,
            "weights": {str(i): [p.detach().tolist() for p in layer.parameters()] for i, layer in enumerate(layers)}}


def build_engine(topology, tensor_group, schedule, options: dict, biased: bool, clip: float, zero: int = 0,
                 training_data=None, bf16: bool = False):
    cfg = {"train_batch_size": N * MICRO * topology.get_dim("data"), "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": clip, "steps_per_print": 1000}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if zero:
        cfg.update(zero_optimization={"stage": zero}, zero_allow_untested_optimizer=True)
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule, "timeout": 60, **options}
    net = PipelineModule(layers=specs(tensor_group, biased), topology=topology, loss_fn=nn.MSELoss(),
                         partition_method="uniform")
    return deepspeed.initialize(model=net, config=cfg, training_data=training_data,
                                optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))[0]


def local_layers(engine) -> dict:
    """Global layer index -> module on this rank (either engine); under Chimera a stage's replicas appear once."""
    if hasattr(engine, "chunk_modules"):
        return {idx: obj for idx, (_, obj) in engine._layer_objects().items()}
    module = engine.module
    return {module._local_start + i: f for i, f in enumerate(module.forward_funcs)}


def whole_weights(engine, tensor_group) -> dict:
    """Every layer's parameters put back together from the tensor ranks' slices (data-parallel copy 0), on every
    rank. A parameter every tensor rank holds whole must be equal on all of them: where it is not, the layer's
    entry is the string "tensor ranks disagree"."""
    mine = []
    if engine.grid.get_data_parallel_id() == 0:
        for idx, layer in local_layers(engine).items():
            if isinstance(layer, nn.Module):
                mine.append((idx, tensor_group.rank, [(name, p.detach().float().clone(),
                                                       bool(getattr(p, "tensor_model_parallel", False)))
                                                      for name, p in layer.named_parameters()]))
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, mine)
    slices: dict = {}
    for per_rank in every:
        for idx, t, params in per_rank:
            slices.setdefault(idx, {})[t] = params
    whole = {}
    for idx, by_rank in sorted(slices.items()):
        ranks = [by_rank[t] for t in sorted(by_rank)]
        out = []
        for k, (name, first, sliced) in enumerate(ranks[0]):
            parts = [r[k][1] for r in ranks]
            if sliced:     # a row-parallel weight is sliced by its input columns, the rest by output rows
                out.append(torch.cat(parts, dim=1 if name == "down.weight" else 0).tolist())
            elif all(torch.equal(part, first) for part in parts):
                out.append(first.tolist())
            else:
                out = "tensor ranks disagree"
                break
        whole[str(idx)] = out
    return whole


def replicas_agree(engine) -> bool:
    """Chimera: both replicas of each stage on this rank hold the same weights after the steps."""
    if not hasattr(engine, "chunk_modules"):
        return True
    seen: dict = {}
    for chunk in engine.chunk_modules.values():
        state = [p.detach().clone() for p in chunk.parameters()]
        if chunk.stage in seen:
            if not all(torch.equal(a, b) for a, b in zip(seen[chunk.stage], state)):
                return False
        seen[chunk.stage] = state
    return True


def broadcast_from_tensor_rank0(tensor_group):
    """A batch_fn as Megatron-DeepSpeed's get_batch_pipe: tensor rank 0 has the batch, the others receive it."""
    def batch_fn(batch):
        box = [batch if tensor_group.rank == 0 else None]
        tdist.broadcast_object_list(box, src=tdist.get_global_rank(tensor_group.group, 0), group=tensor_group.group)
        return box[0]
    return batch_fn


def train(topology, tensor_group, schedule, options, biased, clip, zero=0, feed_tensor_rank0=False,
          training_data=None, bf16=False) -> dict:
    """``feed_tensor_rank0``: only tensor rank 0 gets a data iterator; a batch_fn broadcasts each batch.
    ``bf16``: DeepSpeed's BF16_Optimizer (bf16 weights, fp32 masters and gradients), bf16 batches."""
    engine = build_engine(topology, tensor_group, schedule, options, biased, clip, zero, training_data, bf16)
    if feed_tensor_rank0:
        engine.set_batch_fn(broadcast_from_tensor_rank0(tensor_group))
    dp, d = topology.get_dim("data"), engine.grid.get_data_parallel_id()
    losses, norms = [], []
    for step in range(STEPS):
        mine = batches(step, dp)[d * N:(d + 1) * N]
        if bf16:
            mine = [(x.bfloat16(), y.bfloat16()) for x, y in mine]
        data = iter(mine) if tensor_group.rank == 0 or not feed_tensor_rank0 else None
        losses.append(float(engine.train_batch(data)))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    agree = torch.tensor([1.0 if replicas_agree(engine) else 0.0])
    tdist.all_reduce(agree, op=tdist.ReduceOp.MIN)
    decisions = [None] * tdist.get_world_size()          # "auto": the plan every rank runs
    tdist.all_gather_object(decisions, (getattr(engine, "auto_decision", None) or {}).get("pipeline"))
    return {"losses": losses, "norms": norms, "weights": whole_weights(engine, tensor_group),
            "replicas_agree": bool(agree.item()), "plans": decisions}


def resume(topology, tensor_group, schedule: str, directory: str) -> dict:
    """Save after 2 steps and go on for 2; a new engine loads that save and goes on: the same losses and weights."""
    dp = topology.get_dim("data")

    def steps(engine, start, stop):
        d = engine.grid.get_data_parallel_id()
        return [float(engine.train_batch(iter(batches(step, dp)[d * N:(d + 1) * N]))) for step in range(start, stop)]
    first = build_engine(topology, tensor_group, schedule, SYNCHRONOUS[schedule], True, CLIP)
    steps(first, 0, 2)
    first.save_checkpoint(directory, tag="mid")
    straight = steps(first, 2, 4)
    straight_weights = whole_weights(first, tensor_group)
    second = build_engine(topology, tensor_group, schedule, SYNCHRONOUS[schedule], True, CLIP)
    second.load_checkpoint(directory, tag="mid")
    resumed = steps(second, 2, 4)
    files = sorted(name for name in os.listdir(os.path.join(directory, "mid")) if name.startswith("layer_"))
    return {"straight": straight, "resumed": resumed, "same_weights": straight_weights == whole_weights(
        second, tensor_group), "layer_files": files}


FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 2,
        "min_loss_scale": 1}
FP16_STEPS, OVERFLOW_STEPS = 4, (1, 2)


def train_fp16(topology, tensor_group, schedule: str, poisoned_rank: int) -> dict:
    """fp16 with T > 1: an inf in one chunk's output on one rank at OVERFLOW_STEPS skips those steps everywhere."""
    cfg = {"train_batch_size": N * MICRO * topology.get_dim("data"), "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": CLIP, "steps_per_print": 1000, "fp16": dict(FP16),
           "pipeline": {"schedule": schedule, "timeout": 60, **SYNCHRONOUS[schedule]}}
    net = PipelineModule(layers=specs(tensor_group, True), topology=topology, loss_fn=nn.MSELoss(),
                         partition_method="uniform")
    engine = deepspeed.initialize(model=net, config=cfg,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))[0]
    armed = [False]
    if tdist.get_rank() == poisoned_rank:
        chunk = next(iter(engine.chunk_modules.values()))
        chunk.register_forward_hook(lambda module, args, out: out * float("inf") if armed[0] else out)
    dp, d = topology.get_dim("data"), engine.grid.get_data_parallel_id()
    losses, scales, skipped = [], [], []
    for step in range(FP16_STEPS):
        armed[0] = step in OVERFLOW_STEPS
        losses.append(float(engine.train_batch(iter(batches(step, dp)[d * N:(d + 1) * N]))))
        armed[0] = False
        scales.append(engine.optimizer.cur_scale)
        skipped.append(engine.skipped_steps)
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, (scales, skipped))
    return {"losses": losses, "weights": whole_weights(engine, tensor_group), "scales_skipped": every,
            "dtypes": sorted({str(p.dtype) for c in engine.chunk_modules.values() for p in c.parameters()})}


def reference_fp16(dp: int) -> dict:
    """One process, tensor size 1, the same fp16 algorithm: fp16 weights, fp32 masters, the loss scaled, a step
    with an inf skipped, the clip on the unscaled gradients; the scale by DeepSpeed's own DynamicLossScaler."""
    scaler = deepspeed_loss_scaler(FP16)
    layers = [spec.build() for spec in specs(TensorGroup(), True)]
    params = [p for layer in layers for p in layer.parameters()]
    masters = [p.detach().clone().float() for p in params]
    for p in params:
        p.data = p.data.half()
    opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)
    losses, scales = [], []
    for step in range(FP16_STEPS):
        for p in params:
            p.grad = None
        micro, total = batches(step, dp), 0.0
        overflow = step in OVERFLOW_STEPS
        for x, y in micro:
            out = x.half()
            for layer in layers:
                out = layer(out)
            loss = nn.functional.mse_loss(out, y)
            (loss.float() * scaler.cur_scale / len(micro)).backward()
            total += loss.item() / len(micro)
        if not overflow:
            fp16_master_step(params, masters, opt, scaler.cur_scale, CLIP)
        scaler.update_scale(overflow)
        losses.append(total)
        scales.append(scaler.cur_scale)
    return {"losses": losses, "scales": scales,
            "weights": {str(i): [p.detach().float().tolist() for p in layer.parameters()] for i, layer in
                        enumerate(layers)}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--full", action="store_true", help="make test-full's cases (CI runs a subset)")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=args.dp)
    tensor_group = TensorGroup.of_topology(topology)
    results = {"reference": {f"{model}-{clip}": reference(model == "biased", clip, args.dp)
                             for model, clip in (("sliced", 0.0), ("sliced", CLIP), ("biased", CLIP))}}
    tier = FULL_TIER if args.full else CI_TIER
    for schedule in [None, *SYNCHRONOUS]:
        options = SYNCHRONOUS.get(schedule, {})
        name = schedule or "stock"
        if schedule is None or schedule in tier["unclipped"]:
            results[f"{name}/sliced-0.0"] = train(topology, tensor_group, schedule, options, False, 0.0)
        results[f"{name}/sliced-{CLIP}"] = train(topology, tensor_group, schedule, options, False, CLIP)
        if schedule is not None:
            results[f"{name}/biased-{CLIP}"] = train(topology, tensor_group, schedule, options, True, CLIP)
    for schedule in tier["zero1"]:
        results[f"zero1-{schedule}/biased-{CLIP}"] = train(topology, tensor_group, schedule, SYNCHRONOUS[schedule],
                                                           True, CLIP, zero=1)
    for schedule in ("stock", "zbv"):
        results[f"{schedule}-fed-by-tensor-rank0/sliced-0.0"] = train(
            topology, tensor_group, None if schedule == "stock" else schedule, SYNCHRONOUS.get(schedule, {}), False,
            0.0, feed_tensor_rank0=True)
    # "schedule": "auto" with T = 2: rank 0's tensor group profiles (each tensor rank its shards); planned at
    # initialize on training_data's first micro-batch, and at the first call with data on tensor rank 0 only
    # (Megatron-DeepSpeed's way: the batch_fn broadcasts it)
    first = batches(0, args.dp)[:N]
    data = torch.utils.data.TensorDataset(torch.cat([x for x, _ in first]), torch.cat([y for _, y in first]))
    profile_box = [os.path.join(tempfile.mkdtemp(prefix="ds_chimera_tp_profile_"), "profile.json")
                   if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(profile_box, 0)
    results[f"auto-fed-by-tensor-rank0/biased-{CLIP}"] = train(
        topology, tensor_group, "auto", {"profile_file": profile_box[0]}, True, CLIP, feed_tensor_rank0=True)
    if tdist.get_rank() == 0:      # what the planner priced: one tensor rank's parameters per layer
        with open(profile_box[0]) as fh:
            results["auto-profile-params"] = [layer["params"] for layer in json.load(fh)["layers"]]
    if args.full:
        results[f"auto/biased-{CLIP}"] = train(topology, tensor_group, "auto", {}, True, CLIP, training_data=data)
    # bf16 with T = 2 against the stock engine's bf16 on the same topology (the sliced model: its norm is the true one)
    for schedule in [None, *tier["bf16"]]:
        results[f"bf16-{schedule or 'stock'}/sliced-{CLIP}"] = train(
            topology, tensor_group, schedule, SYNCHRONOUS.get(schedule, {}), False, CLIP, bf16=True)
    results["reference"]["fp16"] = reference_fp16(args.dp)
    for schedule, poisoned in tier["fp16"]:
        results[f"fp16-{schedule}"] = train_fp16(topology, tensor_group, schedule, poisoned)
    box = [tempfile.mkdtemp(prefix="ds_chimera_tp_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(box, 0)
    results["resume-zbv"] = resume(topology, tensor_group, "zbv", box[0])
    tdist.barrier()
    if tdist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    tdist.barrier()


if __name__ == "__main__":
    main()
