"""Wavelet on 4 CPU processes: 2 devices x 2 waves.

    torchrun --nproc_per_node 4 wavelet_worker.py OUT.json             # equivalence run
    torchrun --nproc_per_node 4 wavelet_worker.py --memory OUT.json    # what the tasks hold, counted

(A task's failure ending every task: tests/test_chaos.py.)

Equivalence: every task trains the same small MLP on its own samples; after ``drain()`` rank 0
compares the model with the documented recurrence (ds_chimera.wavelet.wavelet_reference) and
with synchronous data parallelism on the same samples.

Memory: a timed model (each layer sleeps and saves a buffer for its backward) trains three
ways on one engine: waves offset by half a cycle, gang-scheduled (offset 0), and holding each
micro-batch's graph past its backward. Rank 0 writes, per variant, each device's counted rows
(ds_chimera.wavelet.meter, both tasks on one clock) and what each task held after each backward.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as tdist

import deepspeed
import ds_chimera  # noqa: F401
from ds_chimera.wavelet import WaveLayout, wavelet_reference

WIDTH, MICRO, LR = 8, 2, 0.05


def make_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))


def batch(wave, device, step):
    g = torch.Generator().manual_seed(1000 * wave + 100 * device + step)
    return torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)


def make_opt(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def engine_for(timeout, offset=0.5, model=None):
    cfg = {"train_batch_size": MICRO * tdist.get_world_size(), "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
           "wavelet": {"enabled": True, "timeout": timeout, "offset": offset}}
    engine, _, _, _ = deepspeed.initialize(model=model or make_model(), config=cfg, optimizer=make_opt)
    return engine


def train(engine, steps):
    layout = engine.layout
    for step in range(steps):
        x, y = batch(layout.wave, layout.device, step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.drain()


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_gather_object", "broadcast_object_list", "barrier", "isend", "irecv", "send", "recv", "reduce")


def record_groups(calls: list) -> None:
    """Log the ranks of every group a collective or message runs on (what NCCL would build a communicator for)."""
    for name in COLLECTIVES:
        original = getattr(tdist, name)

        def wrapped(*args, original=original, name=name, **kwargs):
            group = kwargs.get("group")
            ranks = tdist.get_process_group_ranks(group) if group not in (None, tdist.group.WORLD) else \
                list(range(tdist.get_world_size()))
            if name in ("isend", "irecv", "send", "recv"):
                peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
                ranks = sorted({tdist.get_rank(), peer})
            calls.append((name, ranks))
            return original(*args, **kwargs)
        setattr(tdist, name, wrapped)


def equivalence(out_path, steps=4):
    calls = []
    record_groups(calls)
    engine = engine_for(60)
    train(engine, steps)
    checkpoint_dir = os.path.join(os.path.dirname(out_path), "ckpt")
    engine.save_checkpoint(checkpoint_dir, tag="t")
    engine.load_checkpoint(checkpoint_dir, tag="t")
    layout = engine.layout
    pairs = [{r, WaveLayout(r, layout.world, layout.local_world).partner} for r in range(layout.world)]
    # (the comparison below is the test's own, on the world group: it comes after)
    shared = sorted({(name, tuple(ranks)) for name, ranks in calls if any(pair <= set(ranks) for pair in pairs)})
    mine = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.zeros_like(mine) for _ in range(tdist.get_world_size())]
    tdist.all_gather(gathered, mine)
    if tdist.get_rank() == 0:
        devices = tdist.get_world_size() // 2
        ref = make_model()
        wavelet_reference(ref, make_opt, torch.nn.functional.mse_loss,
                          lambda wave, step: [batch(wave, d, step) for d in range(devices)], steps)
        ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        sync = make_model()                     # synchronous data parallel: both waves' samples, one update a step
        opt = make_opt(sync.parameters())
        for step in range(2 * steps):            # as many updates, each over the same half of the samples
            wave, j = step % 2, step // 2
            opt.zero_grad()
            for d in range(devices):
                x, y = batch(wave, d, j)
                (torch.nn.functional.mse_loss(sync(x), y) / devices).backward()
            opt.step()
        sync_flat = torch.cat([p.detach().reshape(-1) for p in sync.parameters()])
        result = {"max_diff_reference": max((g - ref_flat).abs().max().item() for g in gathered),
                  "max_diff_between_tasks": max((g - gathered[0]).abs().max().item() for g in gathered),
                  "max_diff_sync": (gathered[0] - sync_flat).abs().max().item(),
                  "global_steps": engine.global_steps, "updates": 2 * steps,
                  "calls": len(calls), "groups_with_a_device_pair": shared,
                  "waves": {"tick": engine.layout.wave_ranks(0), "tock": engine.layout.wave_ranks(1)}}
        with open(out_path + ".tmp", "w") as fh:
            json.dump(result, fh)
        os.replace(out_path + ".tmp", out_path)
    tdist.barrier()
    tdist.destroy_process_group()


LAYER_S, SAVED_FLOATS, WARMUP, MEASURED = 0.02, 2 ** 16, 2, 4


class TimedLayer(torch.autograd.Function):
    """LAYER_S each way; saves SAVED_FLOATS floats for its backward (an activation, for the meter)."""

    @staticmethod
    def forward(ctx, x, weight):
        time.sleep(LAYER_S)
        ctx.save_for_backward(torch.zeros(SAVED_FLOATS))
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(LAYER_S)
        return grad, grad.sum().reshape(1)


class Timed(torch.nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(1)) for _ in range(layers)])

    def forward(self, x):
        for weight in self.weights:
            x = TimedLayer.apply(x, weight)
        return x


def train_metered(engine, meter, retain_graph: bool) -> list:
    """WARMUP + MEASURED steps, sampled after the warm-up; the bytes this task held after each measured backward."""
    x, after, kept = torch.ones(MICRO, WIDTH), [], None
    for step in range(WARMUP + MEASURED):
        if step == WARMUP:
            meter.start()
        with meter.hooks():
            loss = engine(x).sum()
        engine.backward(loss, retain_graph=retain_graph)
        if step >= WARMUP:
            after.append(meter.saved.held)
        kept = loss if retain_graph else None        # the graph, and its saved tensors, live until the next step
        engine.step()
    del kept
    return after


def memory(out_path):
    from ds_chimera.wavelet.meter import Meter
    engine = engine_for(60, model=Timed())
    meter = Meter(engine)
    result = {}
    for name, offset, retain in (("offset", 0.5, False), ("gang", 0.0, False), ("held", 0.5, True)):
        engine.wavelet["offset"] = offset     # read at every step; drain() restarts the tick-tock sequence
        after = train_metered(engine, meter, retain)
        rows = meter.stop()
        engine.drain()
        gathered = [None] * tdist.get_world_size()
        tdist.all_gather_object(gathered, {"rank": tdist.get_rank(), "wave": engine.layout.wave,
                                           "device": engine.layout.device, "rows": rows, "after_backward": after})
        result[name] = gathered
    if tdist.get_rank() == 0:
        with open(out_path + ".tmp", "w") as fh:
            json.dump(result, fh)
        os.replace(out_path + ".tmp", out_path)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    if sys.argv[1] == "--memory":
        memory(sys.argv[2])
    else:
        equivalence(sys.argv[1])
