"""4 gloo ranks: Megatron-Core GPT chunks trained through ds_chimera's Megatron contract.

For every case the gradients, the returned loss dicts and a forward-only call are compared
with single-process training of one whole GPTModel holding the same weights, on the same
global batch. Writes one JSON result per rank: python megatron_worker.py OUT_DIR
"""
import json
import os
import re
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_chimera.megatron as dsm  # noqa: E402
from ds_chimera.config import PipelineConfig  # noqa: E402
from ds_chimera.megatron.stages import megatron_stage, pipeline_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiers import FULL  # noqa: E402

VOCAB, SEQ, MBS, LAYERS, HIDDEN = 32, 8, 2, 8, 16
N = 8
CASES = [  # (schedule, options, pipeline size, loss form)
    ("1f1b", {}, 4, 3), ("interleaved", {"chunks": 2}, 4, 2), ("chimera", {}, 4, 3), ("zb-h1", {}, 4, 2),
    ("zbv", {}, 4, 3), ("chimera", {"order": "zero-bubble", "pipelines": 2}, 4, 3),  # a loss stage on every rank
    ("chimera", {}, 2, 2),     # 2 x 2 pipe x data
    # gradients kept in main_grad by an accumulation hook, as Megatron's DDP does
    ("zb-h1", {}, 4, 2, "main_grad"), ("chimera", {}, 4, 3, "main_grad"),
]
# make test-full adds the other synchronous schedules (each one's equivalence runs in CI on DeepSpeed:
# tests/test_runtime_deepspeed.py) and Chimera's zero-bubble order with one pipeline pair
FULL_CASES = [("gpipe", {}, 4, 2), ("breadth-first", {"chunks": 2}, 4, 3), ("dualpipev", {}, 4, 2),
              ("chimera", {"order": "zero-bubble"}, 4, 2), ("interleaved", {"chunks": 2}, 2, 3)]
if FULL:
    CASES += FULL_CASES


def gpt_config(pp: int, vpp):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                             pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)


def provider_for(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                        max_sequence_length=SEQ, pre_process=pre_process, post_process=post_process,
                        vp_stage=vp_stage)
    return model_provider


def micro_batch(dp_rank: int, mb: int):
    g = torch.Generator().manual_seed(1000 * dp_rank + mb)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


POSITIONS = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
MASK = dsm.causal_mask(SEQ)


def forward_step_for(loss_form: int):
    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, POSITIONS, MASK, labels=labels)

        def loss_func(per_token):
            if loss_form == 3:
                total = per_token.float().sum()
                n = torch.tensor(per_token.numel(), dtype=torch.int)
                return total, n, {"lm loss": (total / n).detach()}
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func
    return forward_step


def to_full_name(name: str, stage: int, layers_per_stage: int) -> str:
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        return f"decoder.layers.{stage * layers_per_stage + int(m.group(1))}.{m.group(2)}"
    return name


def keep_grads_in_main_grad(chunks):
    """Megatron DDP's gradient path: every accumulation lands in param.main_grad, .grad is cleared."""
    def accumulate(p):
        p.main_grad.add_(p.grad)
        p.grad = None
    for chunk in chunks:
        for p in chunk.parameters():
            p.main_grad = torch.zeros_like(p)
            p.register_post_accumulate_grad_hook(accumulate)


# (loss form, data-parallel size and rank, the weights' fingerprint) -> (the whole model after its backward,
# Megatron's own loss dicts, the reference losses): computed once for the cases that share them
_REFERENCES: dict = {}


def run_case(schedule, options, pp, loss_form, rank, world, grads="grad"):
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    group = pipeline_group()
    dp, dp_rank = world // pp, parallel_state.get_data_parallel_rank()
    fb = dsm.get_forward_backward_func(schedule, timeout=60, **options)
    sched = PipelineConfig.from_megatron(schedule, options).build_schedule(pp, N)
    total = sched.placement.num_stages
    vpp = total // pp if total > pp else None
    config = gpt_config(pp, vpp)
    calls = []

    def finalize(model, num_tokens, **kwargs):         # Megatron DDP's role: average over data parallel
        calls.append(num_tokens)
        dp_group = parallel_state.get_data_parallel_group()
        for chunk in model:
            for p in chunk.parameters():
                if p.grad is not None and dp > 1:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dp)
    config.finalize_model_grads_func = finalize
    provider = provider_for(config)
    chunks = dsm.build_model_chunks(provider, schedule, **options)
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    if grads == "main_grad":
        keep_grads_in_main_grad(chunks)
    batches = [micro_batch(dp_rank, mb) for mb in range(N)]
    hooks = lambda: sum(len(m._forward_hooks) for chunk in chunks for m in chunk.modules())     # noqa: E731
    hooks_before = hooks()
    losses = fb(forward_step_func=forward_step_for(loss_form), data_iterator=iter(batches), model=chunks,
                num_microbatches=N, seq_length=SEQ, micro_batch_size=MBS)
    with torch.no_grad():
        eval_losses = fb(forward_step_func=forward_step_for(loss_form), data_iterator=iter(batches), model=chunks,
                         num_microbatches=N, seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
    hooks_added = hooks() - hooks_before      # a split backward's block hooks come off when the call ends

    # the reference: one whole GPTModel with every stage's weights, trained in this process
    per_stage = LAYERS // total

    def whole_model(state):
        with megatron_stage(0, 1, 1, group):
            model = provider_for(gpt_config(1, None))(pre_process=True, post_process=True)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not [k for k in missing if not k.endswith("_extra_state")], missing
        return model
    state = {}
    for stage in range(total):
        with megatron_stage(stage, pp, total, group), torch.random.fork_rng(devices=[]):
            torch.manual_seed(dsm.stages.DEFAULT_SEED + stage)
            built = provider(pre_process=stage == 0, post_process=stage == total - 1,
                             vp_stage=stage // pp if vpp else None)
        for name, value in built.state_dict().items():
            state[to_full_name(name, stage, per_stage)] = value
    key = (loss_form, dp, dp_rank, tuple((k, tuple(v.shape), float(v.double().sum()), float(v.double().abs().sum()))
                                         for k, v in sorted(state.items()) if torch.is_tensor(v)))
    if key not in _REFERENCES:    # cases with the same weights (same stage count) share the reference's work
        full = whole_model(state)
        own = megatrons_own_dicts(whole_model(state), forward_step_for(loss_form),
                                  [micro_batch(dp_rank, mb) for mb in range(N)])
        losses_here = []
        for d in range(dp):
            for mb in range(N):
                tokens, labels = micro_batch(d, mb)
                loss = full(tokens, POSITIONS, MASK, labels=labels).float().mean()
                (loss / (N * dp)).backward()
                if d == dp_rank:
                    losses_here.append(loss.item())
        _REFERENCES[key] = (full, own, losses_here)
    full, (own_dicts, own_eval_dicts), ref_losses = _REFERENCES[key]
    ref_grads = dict(full.named_parameters())
    grad_diff, weight_diff, grad_norm = 0.0, 0.0, 0.0
    for chunk in chunks:
        stage = chunk._ds_chimera_stage
        for name, p in chunk.named_parameters():
            ref = ref_grads[to_full_name(name, stage, per_stage)]
            weight_diff = max(weight_diff, (p.detach() - ref.detach()).abs().max().item())
            got = p.main_grad if grads == "main_grad" else p.grad
            if got is None or (grads == "main_grad" and p.grad is not None):
                raise RuntimeError(f"stage {stage} {name}: gradient not where it belongs ({grads})")
            grad_diff = max(grad_diff, (got - ref.grad).abs().max().item())
            grad_norm += ref.grad.double().pow(2).sum().item()
    holds_loss = any(c._ds_chimera_stage == total - 1 for c in chunks)
    got = [float(d["lm loss"]) for d in losses]
    got_eval = [float(d["lm loss"]) for d in eval_losses]
    own = [float(d["lm loss"]) for d in own_dicts]
    own_eval = [float(d["lm loss"]) for d in own_eval_dicts]
    # the dicts as Megatron-Core's own schedule returns them for the same forward_step_func and loss_func
    dict_diff = max(abs(a - b) for a, b in zip(got, own, strict=True)) if got else None
    eval_dict_diff = max(abs(a - b) for a, b in zip(got_eval, own_eval, strict=True)) if got_eval else None
    return {"schedule": schedule, "options": options, "pp": pp, "grads": grads,
            "stages": [c._ds_chimera_stage for c in chunks], "grad_diff": grad_diff, "weight_diff": weight_diff,
            "grad_norm": grad_norm ** 0.5, "holds_loss": holds_loss, "pipe_rank": dist.get_rank(group),
            "losses": len(got), "eval_losses": len(got_eval), "dict_diff": dict_diff,
            "eval_dict_diff": eval_dict_diff, "own_dicts": len(own), "loss_form": loss_form,
            "divided_in_place": bool(got) and abs(got[0] - ref_losses[0] / N) <= 1e-6,
            "finalize_calls": len(calls), "hooks_added": hooks_added}


def run_auto(out_dir: str, rank: int, world: int) -> dict:
    """"auto": the first call runs the layout's schedule timed, then the planner's choice; the gradients of both
    calls (same weights, no optimizer step between) are the same, and every rank chose the same. Megatron's own
    layout (one chunk per rank), and Chimera's chunks profiled under the merged order with a budget only concat
    meets (a switch of schedule)."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
    out = {}
    for label, built, options in (("layout", ("auto", {}), {}),
                                  ("chimera", ("chimera", {"order": "merged"}), {"max_activations": 4})):
        plan_file = os.path.join(out_dir, f"megatron_plan_{label}.json")
        fb = dsm.get_forward_backward_func("auto", timeout=60, plan_file=plan_file, **options)
        chunks = dsm.build_model_chunks(provider_for(gpt_config(4, None)), built[0], **built[1])
        batches = [micro_batch(0, mb) for mb in range(N)]
        grads = []
        for _ in range(2):
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            fb(forward_step_func=forward_step_for(2), data_iterator=iter(batches), model=chunks,
               num_microbatches=N, seq_length=SEQ, micro_batch_size=MBS)
            grads.append([p.grad.clone() for chunk in chunks for p in chunk.parameters()])
        runner = fb.runner
        # another micro-batch count plans again from the same profile, without profiling again
        fb(forward_step_func=forward_step_for(2), data_iterator=iter(batches[:4]), model=chunks,
           num_microbatches=4, seq_length=SEQ, micro_batch_size=MBS)
        dist.barrier()
        out[label] = {"profiled_with": [runner.layout.schedule, dict(runner.layout.options)],
                      "chosen": {n: [runner.decisions[(4, n)].schedule, dict(runner.decisions[(4, n)].options)]
                                 for n in (N, 4)},
                      "grad_diff": max((a - b).abs().max().item() for a, b in zip(*grads)),
                      "grad_norm": sum(g.double().pow(2).sum().item() for g in grads[1]) ** 0.5,
                      "report": runner.reports[(4, N)],
                      "stage_fwd": [layer.fwd for layer in runner.profile.layers],
                      "stage_wgrad": [layer.wgrad for layer in runner.profile.layers],
                      "plan_file": json.load(open(plan_file)) if rank == 0 else None}
    # a later start with that plan_file runs its plans as written: no profiling call
    fb = dsm.get_forward_backward_func("auto", timeout=60, plan_file=plan_file, max_activations=4)
    fb(forward_step_func=forward_step_for(2), data_iterator=iter(batches), model=chunks, num_microbatches=N,
       seq_length=SEQ, micro_batch_size=MBS)
    out["rerun"] = {"profiled": fb.runner.profile is not None,
                    "chosen": [fb.runner.decisions[(4, N)].schedule, dict(fb.runner.decisions[(4, N)].options)]}
    return {"auto": out}


def megatrons_own_dicts(model, forward_step, batches):
    """Megatron-Core's own schedule (no pipelining, one whole model) on this rank's micro-batches: the
    loss dicts it returns for training and for forward only. Its one CUDA allocation is kept on CPU."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    zeros = torch.zeros

    def cpu_zeros(*args, device=None, **kwargs):
        return zeros(*args, **kwargs) if device == "cuda" else zeros(*args, device=device, **kwargs)
    torch.zeros = cpu_zeros
    try:
        kwargs = dict(forward_step_func=forward_step, model=[model], num_microbatches=len(batches), seq_length=SEQ,
                      micro_batch_size=MBS)
        train = forward_backward_no_pipelining(data_iterator=iter(batches), **kwargs)
        with torch.no_grad():
            evaluation = forward_backward_no_pipelining(data_iterator=iter(batches), forward_only=True, **kwargs)
    finally:
        torch.zeros = zeros
    return train, evaluation


def run_refusals():
    """Set-ups the contract refuses on every rank before any message moves."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
    config = gpt_config(4, None)
    chunks = dsm.build_model_chunks(provider_for(config), "zb-h1")
    batches = [micro_batch(0, mb) for mb in range(N)]
    messages = {}
    for key, change, kwargs in (("fusion", {"gradient_accumulation_fusion": True}, {}),
                                ("recompute", {"recompute_granularity": "full"}, {}),
                                ("non-loss-training", {}, {"collect_non_loss_data": True})):
        saved = {k: getattr(config, k) for k in change}
        for k, v in change.items():
            setattr(config, k, v)
        try:
            dsm.get_forward_backward_func("zb-h1", timeout=30)(
                forward_step_func=forward_step_for(2), data_iterator=iter(batches), model=chunks, num_microbatches=N,
                seq_length=SEQ, micro_batch_size=MBS, **kwargs)
            messages[key] = None
        except ValueError as exc:
            messages[key] = str(exc)
        for k, v in saved.items():
            setattr(config, k, v)
    # chunks in another layout than the schedule's, found before the first forward
    looped = dsm.build_model_chunks(provider_for(gpt_config(4, 2)), "interleaved", chunks=2)
    for key, chunks in (("tagged-layout", looped), ("megatron-layout", looped)):
        if key == "megatron-layout":       # as Megatron's own get_model builds them: no ds_chimera tags
            for chunk in chunks:
                del chunk._ds_chimera_stage, chunk._ds_chimera_built_for
        try:
            dsm.get_forward_backward_func("zbv", timeout=30)(
                forward_step_func=forward_step_for(2), data_iterator=iter(batches), model=chunks, num_microbatches=N,
                seq_length=SEQ, micro_batch_size=MBS)
            messages[key] = None
        except ValueError as exc:
            messages[key] = str(exc)
    # Chimera's replicas from chunks not built for it, on one rank only: every rank refuses, naming that rank
    import torch.distributed as tdist
    chimera = dsm.build_model_chunks(provider_for(gpt_config(4, None)), "chimera")
    if tdist.get_rank() == 2:
        chimera = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
        for chunk in chimera:
            chunk.config = config
    # Megatron's virtual-pipeline chunks (no ds_chimera tags) under install("1f1b"): the hint names interleaved
    virtual = dsm.build_model_chunks(provider_for(gpt_config(4, 2)), "interleaved", chunks=2)
    for chunk in virtual:
        del chunk._ds_chimera_stage, chunk._ds_chimera_built_for
    for key, schedule, chunks in (("bare-chimera", "chimera", chimera), ("virtual-1f1b", "1f1b", virtual)):
        try:
            dsm.get_forward_backward_func(schedule, timeout=30)(
                forward_step_func=forward_step_for(2), data_iterator=iter(batches), model=chunks, num_microbatches=N,
                seq_length=SEQ, micro_batch_size=MBS)
            messages[key] = None
        except ValueError as exc:
            messages[key] = str(exc)
    return {"refusals": messages}


def run_installed(rank, world):
    """install(): Megatron's own get_forward_backward_func() now returns the chimera schedule."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    import megatron.core.pipeline_parallel as pipeline_parallel
    dsm.install("chimera", timeout=60)
    chosen = pipeline_parallel.get_forward_backward_func()
    dsm.uninstall()
    restored = pipeline_parallel.get_forward_backward_func
    # build_model_chunks() with no schedule builds what the installed routing runs, V from Megatron's VP size
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
                                             virtual_pipeline_model_parallel_size=2)
    dsm.install("breadth-first", timeout=60)
    built = dsm.build_model_chunks(provider_for(gpt_config(4, 2)))
    dsm.uninstall()
    return {"installed": getattr(chosen, "schedule", None), "restored_is_megatron": restored is get_forward_backward_func,
            "built_for": [list(c._ds_chimera_built_for) for c in built], "built_stages": [c._ds_chimera_stage for c in built]}


def run_dist_checkpoints(out_dir: str, rank: int) -> dict:
    """Megatron dist_checkpointing of chunk lists: chimera (replicas) -> zbv, interleaved and Megatron's own
    plain pipeline (loaded with Megatron's API alone), and plain -> chimera. Every round trip is exact."""
    from megatron.core import dist_checkpointing, parallel_state
    layouts = {"chimera": ({}, None), "zbv": ({}, 2), "interleaved": ({"chunks": 2}, 2)}

    def chunks_for(name):
        options, vp = layouts[name]
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
                                                 virtual_pipeline_model_parallel_size=vp)
        return dsm.build_model_chunks(provider_for(gpt_config(4, vp)), name, **options)

    def plain_megatron():
        """Megatron's own PP=4 model on this rank (no ds_chimera): stage = pipeline rank."""
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
        torch.manual_seed(99)
        pp = parallel_state.get_pipeline_model_parallel_rank()
        model = provider_for(gpt_config(4, None))(pre_process=pp == 0, post_process=pp == 3)
        model._plain_stage = pp
        return [model]

    def by_global_name(model, total):
        per, out = LAYERS // total, {}
        for chunk in model:
            stage = getattr(chunk, "_ds_chimera_stage", getattr(chunk, "_plain_stage", None))
            for name, value in chunk.state_dict().items():
                if not name.endswith("_extra_state"):
                    out[to_full_name(name, stage, per)] = value.detach().clone()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        merged = {}
        for part in gathered:
            for key, value in part.items():
                if key in merged and not torch.equal(merged[key], value):
                    raise AssertionError(f"replicas of {key} differ")
                merged[key] = value
        return merged

    def folder(name):
        path = os.path.join(out_dir, "dist-ckpt", name)
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        return path

    results = {}
    source = chunks_for("chimera")
    with torch.no_grad():        # distinct weights per stage, the same on both replicas of a stage
        for chunk in source:
            g = torch.Generator().manual_seed(chunk._ds_chimera_stage)
            for p in chunk.parameters():
                p.add_(torch.randn(p.shape, generator=g))
    saved = by_global_name(source, 4)
    path = folder("chimera")
    dsm.save_checkpoint(source, path, "chimera")
    for name in ("zbv", "interleaved", "chimera"):
        target = chunks_for(name)
        dsm.load_checkpoint(target, path, name, **layouts[name][0])
        got = by_global_name(target, 8 if name != "chimera" else 4)
        results[f"chimera->{name}"] = [sorted(got) == sorted(saved), max((got[k] - saved[k]).abs().max().item()
                                                                       for k in saved)]
    plain = plain_megatron()          # Megatron's own API: no ds_chimera in the load
    state = dist_checkpointing.load({"model0": plain[0].sharded_state_dict()}, path)
    plain[0].load_state_dict(state["model0"])
    got = by_global_name(plain, 4)
    results["chimera->plain"] = [sorted(got) == sorted(saved), max((got[k] - saved[k]).abs().max().item()
                                                                 for k in saved)]
    with torch.no_grad():
        for p in plain[0].parameters():
            p.mul_(0.5)
    saved = by_global_name(plain, 4)
    path = folder("plain")
    dist_checkpointing.save({"model0": plain[0].sharded_state_dict()}, path)
    target = chunks_for("chimera")
    dsm.load_checkpoint(target, path, "chimera")
    got = by_global_name(target, 4)
    results["plain->chimera"] = [sorted(got) == sorted(saved), max((got[k] - saved[k]).abs().max().item()
                                                                 for k in saved)]
    results["tensors"] = len(saved)
    return {"dist_checkpoints": results}


def run_caught_failure() -> dict:
    """Rank 1's forward_step raises in a training call; every rank catches. The same groups refuse at
    once; after Megatron's groups are rebuilt, the same chunks give the losses they gave before."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
    fb = dsm.get_forward_backward_func("1f1b", timeout=30)
    chunks = dsm.build_model_chunks(provider_for(gpt_config(4, None)), "1f1b")
    batches = [micro_batch(0, mb) for mb in range(N)]
    plain, calls = forward_step_for(2), []

    def failing(data_iterator, model):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 3:
            raise RuntimeError("injected failure in rank 1's forward_step")
        return plain(data_iterator, model)

    def call(forward_only, step=plain):
        dicts = fb(forward_step_func=step, data_iterator=iter(batches), model=chunks, num_microbatches=N,
                   seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only)
        return [float(d["lm loss"]) for d in dicts]

    def raised(work) -> str:
        try:
            work()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "nothing raised"
    before = call(True)
    # every rank done with the forward-only call before rank 1 can fail in the next: rank 1 does not wait for the
    # ranks after it to finish a forward-only call, and one still in it would learn of the failure outside raised()
    # and end the launch (seen once: ranks 2 and 3 "stop too ... in forward_backward_func (1f1b, forward only)")
    dist.barrier()
    first = raised(lambda: call(False, failing))
    # on stdout as each rank sees it, call by call: the launch's output shows where a rank that ended went wrong
    print(f"caught-failure rank {dist.get_rank()}: first: {first[:200]}", flush=True)
    again = raised(lambda: call(True))
    print(f"caught-failure rank {dist.get_rank()}: again: {again[:200]}", flush=True)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
    return {"caught_failure": {"first": first, "again": again, "before": before, "after": call(True)}}


def run_dead_rank(timeout_s: float):
    """Rank 3 dies after building its chunk; the others must fail with a clear error, not hang."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
    fb = dsm.get_forward_backward_func("1f1b", timeout=timeout_s)
    chunks = dsm.build_model_chunks(provider_for(gpt_config(4, None)), "1f1b")
    if dist.get_rank() == int(os.environ.get("DIE_RANK", "3")):
        os._exit(17)
    batches = [micro_batch(0, mb) for mb in range(N)]
    fb(forward_step_func=forward_step_for(2), data_iterator=iter(batches), model=chunks, num_microbatches=N,
       seq_length=SEQ, micro_batch_size=MBS)
    print("finished the step", flush=True)


def run_auto_fault(victim: int) -> None:
    """"auto": after the first (timed) call every rank measures the links; ``victim`` fails in that measurement, and
    its script goes on after catching it (so its process's end is not what frees the others). Each rank prints what
    its call raised, with the time; the victim's failure time comes first."""
    import time

    import ds_chimera.planner.links as links
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
    measured = links.measure_links

    def failing(*args, **kwargs):
        if dist.get_rank() == victim:
            print(f"auto-fault at {time.time()}", flush=True)
            raise RuntimeError(f"injected failure on rank {victim} while the links are measured")
        return measured(*args, **kwargs)
    links.measure_links = failing
    fb = dsm.get_forward_backward_func("auto", timeout=30)
    chunks = dsm.build_model_chunks(provider_for(gpt_config(4, None)), "auto")
    batches = [micro_batch(0, mb) for mb in range(N)]
    try:
        fb(forward_step_func=forward_step_for(2), data_iterator=iter(batches), model=chunks, num_microbatches=N,
           seq_length=SEQ, micro_batch_size=MBS)
    except Exception as exc:      # noqa: BLE001  (what the script sees)
        print(f"auto-fault caught at {time.time()}: {type(exc).__name__}: {exc}"[:600], flush=True)
        if dist.get_rank() == victim:
            time.sleep(12.0)      # beyond the test's bound: the others must end before this process does
        return
    print("finished the step", flush=True)


def main():
    if sys.argv[1] == "dead":
        dist.init_process_group("gloo")
        dsm.enable_cpu()
        run_dead_rank(float(sys.argv[2]))
        return
    if sys.argv[1] == "auto-fault":
        dist.init_process_group("gloo")
        dsm.enable_cpu()
        run_auto_fault(int(sys.argv[2]))
        return
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dsm.enable_cpu()
    results = [run_case(*case[:4], rank, world, *case[4:]) for case in CASES]
    results.append(run_caught_failure())
    results.append(run_auto(out_dir, rank, world))
    results.append(run_dist_checkpoints(out_dir, rank))
    results.append(run_refusals())
    results.append(run_installed(rank, world))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
