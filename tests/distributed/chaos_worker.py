"""One rank of a chaos case: train, checkpoint, and (on the victim) fail at one point.

    python chaos_worker.py ENGINE OUTDIR        (4 plain processes, no launcher: see tests/chaos.py)

ENGINE: a pipeline schedule (1f1b, chimera, zbv, pipeoptim) or ``wavelet``. Environment:
CHAOS="VICTIM:POINT:FAULT" injects FAULT (raise, kill, stop) at POINT (forward, backward,
send, receive, sync, step, save) on rank VICTIM during step FAULT_STEP; PHASE=resume
instead loads the latest checkpoint and trains the remaining steps. Every rank writes
OUTDIR/PHASE-rankR.json with its losses and the one-process reference's; the victim
writes OUTDIR/fault.json with the time it failed. CATCH=1: every rank wraps train_batch in
try/except, as a script that saves or reports on failure does, writes what it caught to
OUTDIR/caught-rankR.json (and what a second train_batch raised), and ends normally. RECOVER=1 (with
CATCH=1): after the failure every rank builds a new engine, loads the latest checkpoint and trains
the remaining steps (or records the refusal, when a rank died), then calls the failed engine again.
"""
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as tdist

import deepspeed
import ds_chimera  # noqa: F401
from deepspeed.pipe import LayerSpec, PipelineModule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import BASE_SEED, WIDTH, build_reference, make_global_batches, run_reference  # noqa: E402

ENGINE, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])
TIMEOUT = float(os.environ.get("CHAOS_TIMEOUT", "10"))
STEPS, SAVE_AFTER, FAULT_STEP = 6, (2, 4), 3     # saves after steps 2 and 4; the fault in step 3 (0-based)
N, LR, CLIP = 8, 0.05, 0.5
victim, point, fault = (os.environ["CHAOS"].split(":") if os.environ.get("CHAOS") else (None, None, None))
victim = int(victim) if victim is not None else None
state = {"step": -1, "fired": False}


def maybe_fail(where: str) -> None:
    """The injection: on the victim, at its point, in the fault step (or during the second save)."""
    if RANK != victim or where != point or state["fired"]:
        return
    if state["step"] != FAULT_STEP:       # a save fails in the save after step FAULT_STEP: the one before is whole
        return
    state["fired"] = True
    with open(os.path.join(OUT, "fault.json.tmp"), "w") as fh:
        json.dump({"time": time.time(), "rank": RANK, "point": point, "fault": fault}, fh)
    os.replace(os.path.join(OUT, "fault.json.tmp"), os.path.join(OUT, "fault.json"))
    if fault == "raise":
        raise RuntimeError(f"chaos: injected failure at {point} on rank {RANK}")
    os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


class ChaosLinear(torch.nn.Linear):
    """A layer that can fail in its forward or in its backward."""

    def forward(self, x):
        maybe_fail("forward")
        return _BackwardProbe.apply(super().forward(x))


class _BackwardProbe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        maybe_fail("backward")
        return grad


def specs():
    out = []
    for i in range(16):
        out.append(LayerSpec(ChaosLinear, WIDTH, WIDTH) if i % 2 == 0 else LayerSpec(torch.nn.Tanh))
    return out


def patch_points() -> None:
    """send, receive, sync and save through the runtime's own functions."""
    from ds_chimera.runtime import checkpoint, host, p2p

    def around(owner, name, where):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            maybe_fail(where)
            return original(*args, **kwargs)
        setattr(owner, name, wrapped)
    around(p2p.P2P, "send", "send")
    around(p2p.P2P, "recv", "receive")
    around(host.PipelineHost, "wait_grad_syncs", "sync")
    around(checkpoint, "save_layers", "save")


def pipeline_engine():
    net = PipelineModule(layers=specs(), num_stages=4, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         seed_layers=True, base_seed=BASE_SEED)
    cfg = {"train_batch_size": N * 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
           "steps_per_print": 1000, "pipeline": {"schedule": ENGINE, "timeout": TIMEOUT}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg,
                                           optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))
    original_step = engine.optimizer.step

    def step(*args, **kwargs):
        maybe_fail("step")
        return original_step(*args, **kwargs)
    engine.optimizer.step = step
    return engine


def pipeline_reference(engine) -> list:
    """Losses of the uninterrupted run, in one process (LocalPipeline for an asynchronous schedule)."""
    layers = build_reference(specs())
    batches = make_global_batches(N)
    if engine.schedule.synchronous:
        return run_reference(layers, batches, STEPS, LR, CLIP)[0]
    from ds_chimera.runtime.local import LocalPipeline
    from ds_chimera.schedules import registry
    parts = engine.plan.parts
    stages = [torch.nn.Sequential(*layers[parts[k]:parts[k + 1]]) for k in range(4)]
    local = LocalPipeline(registry.build(ENGINE, 4, N), stages,
                          [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in stages],
                          torch.nn.functional.mse_loss, clip=CLIP)
    return [local.train_batch(batches(step)) for step in range(STEPS)]


def run_pipeline(phase: str) -> dict:
    patch_points()
    engine = pipeline_engine()
    ckpt = os.path.join(OUT, "ckpt")
    first = 0
    if phase == "resume":
        _, client = engine.load_checkpoint(ckpt)
        first = client["steps_done"]
    batches = make_global_batches(N)
    losses = {}
    for step in range(first, STEPS):
        state["step"] = step
        if os.environ.get("CATCH") == "1":
            try:
                losses[step] = engine.train_batch(iter(batches(step))).item()
            except Exception as exc:
                result = {"caught": caught(exc), "again": call_again(engine, batches(step))}
                if os.environ.get("RECOVER") == "1":
                    write_json(os.path.join(OUT, f"caught-rank{RANK}.json"), result)
                    result["recovered"] = recover(engine, ckpt, batches)
                return result
        else:
            losses[step] = engine.train_batch(iter(batches(step))).item()
        if step + 1 in SAVE_AFTER:
            engine.save_checkpoint(ckpt, tag=f"global_step{step + 1}", client_state={"steps_done": step + 1})
    return {"first": first, "losses": losses, "reference": pipeline_reference(engine),
            "left": sorted(os.listdir(ckpt))}


def caught(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "time": time.time()}


def recover(failed, ckpt: str, batches) -> dict:
    """What a script that goes on after a failure does: a new engine, the latest checkpoint, the rest."""
    try:
        engine = pipeline_engine()
    except Exception as exc:
        return caught(exc)
    try:
        _, client = engine.load_checkpoint(ckpt)
        first = client["steps_done"]
        losses = {}
        for step in range(first, STEPS):
            losses[step] = engine.train_batch(iter(batches(step))).item()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"first": first, "losses": losses, "reference": pipeline_reference(engine),
            "old_engine": call_again(failed, batches(first))}


def call_again(engine, batch) -> dict:
    """A second train_batch after the failure: it must raise at once, not run into the broken groups."""
    start = time.time()
    try:
        engine.train_batch(iter(batch))
    except Exception as exc:
        return {**caught(exc), "seconds": time.time() - start}
    return {"type": None, "seconds": time.time() - start}


# ---- Wavelet: 2 devices x 2 waves, plain SGD (no optimizer state: the reference restarts cleanly) -----
def wavelet_batch(wave, device, step):
    g = torch.Generator().manual_seed(1000 * wave + 100 * device + step)
    return torch.randn(2, WIDTH, generator=g), torch.randn(2, WIDTH, generator=g)


def wavelet_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(ChaosLinear(WIDTH, WIDTH), torch.nn.Tanh(), ChaosLinear(WIDTH, WIDTH))


def run_wavelet(phase: str) -> dict:
    from ds_chimera.wavelet import engine as wavelet_engine
    from ds_chimera.wavelet import wavelet_reference

    def around(name, where):
        original = getattr(wavelet_engine.WaveletEngine, name)

        def wrapped(self, *args, **kwargs):
            maybe_fail(where)
            return original(self, *args, **kwargs)
        setattr(wavelet_engine.WaveletEngine, name, wrapped)
    around("_send", "send")
    around("_recv_partner", "receive")
    around("_wave_average", "sync")
    around("_take_model_step", "step")
    cfg = {"train_batch_size": 2 * tdist.get_world_size(), "train_micro_batch_size_per_gpu": 2,
           "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
           "wavelet": {"enabled": True, "timeout": TIMEOUT}}
    engine, _, _, _ = deepspeed.initialize(model=wavelet_model(), config=cfg,
                                           optimizer=lambda p: torch.optim.SGD(p, lr=LR))
    import deepspeed.runtime.engine as ds_engine
    original_save = ds_engine.DeepSpeedEngine.save_checkpoint

    def save(self, *args, **kwargs):
        maybe_fail("save")
        return original_save(self, *args, **kwargs)
    ds_engine.DeepSpeedEngine.save_checkpoint = save
    ckpt = os.path.join(OUT, "ckpt")
    first = 0
    if phase == "resume":
        _, client = engine.load_checkpoint(ckpt)
        first = client["steps_done"]
    layout, losses = engine.layout, {}
    for step in range(first, STEPS):
        state["step"] = step
        x, y = wavelet_batch(layout.wave, layout.device, step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses[step] = loss.item()
        if step + 1 in SAVE_AFTER:
            engine.save_checkpoint(ckpt, tag=f"global_step{step + 1}", client_state={"steps_done": step + 1})
    engine.drain()
    # the reference: the recurrence restarted at every save (a save drains: every task then holds all updates)
    ref_model = wavelet_model()
    devices = tdist.get_world_size() // 2
    bounds = [0, *SAVE_AFTER, STEPS]
    for a, b in zip(bounds, bounds[1:]):
        wavelet_reference(ref_model, lambda p: torch.optim.SGD(p, lr=LR), torch.nn.functional.mse_loss,
                          lambda wave, j, a=a: [wavelet_batch(wave, d, a + j) for d in range(devices)], b - a)
    mine = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    ref = torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()])
    return {"first": first, "losses": losses, "final_param_diff": (mine - ref).abs().max().item(),
            "left": sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []}


def write_json(path: str, value) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump(value, fh)
    os.replace(path + ".tmp", path)


def main():
    phase = os.environ.get("PHASE", "fault")
    deepspeed.init_distributed(dist_backend="gloo")
    result = run_wavelet(phase) if ENGINE == "wavelet" else run_pipeline(phase)
    write_json(os.path.join(OUT, f"{'caught' if 'caught' in result else phase}-rank{RANK}.json"), result)
    if "caught" in result:
        recovered = result.get("recovered", {})
        if "losses" in recovered:       # the default group was left whole: it still works
            tdist.barrier()
            print("recovered and finished", flush=True)
        print("caught the failure and carried on", flush=True)
        return
    tdist.barrier()
    print("finished all steps", flush=True)


if __name__ == "__main__":
    main()
