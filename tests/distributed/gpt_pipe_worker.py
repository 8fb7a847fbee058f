"""A PipelineModule built the way Megatron-DeepSpeed's GPTModelPipe is, trained the way its pretrain_gpt.py trains
it, under DeepSpeed's stock engine and under each ds_chimera schedule in one 4-rank launch.

The shape (written here, not copied): a tied embedding (``TiedLayerSpec`` on the first and the last layer, the
last one projecting onto the vocabulary through ``forward_fn``), transformer blocks cut with
``partition_method="type:transformer"``, dict batches turned into ((tokens, positions), (labels, loss mask)) by the
engine's ``batch_fn``, an optimizer instance over weight-decay / no-decay groups with an LR-scheduler instance
bound to it (megatron-core's ``OptimizerParamScheduler``), ``set_train_batch_size`` before every iteration, and
data handed only to ``train_batch``.

Usage: torchrun --nproc_per_node 4 gpt_pipe_worker.py OUT.json SCENARIO[,SCENARIO...]
"""
import os
import sys
import tempfile
import time

import torch
import torch.distributed as tdist
from torch import nn

import deepspeed
import ds_chimera  # noqa: F401  (installs the "pipeline": {"schedule": ...} switch)
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenarios import run_scenarios  # noqa: E402

VOCAB, HIDDEN, SEQ, MICRO, BLOCKS = 32, 16, 8, 2, 8
BASE_SEED = 4321
STEPS = 4


class TokenEmbedding(nn.Module):
    """Word and position embeddings; its word table is also the output projection (tied)."""

    def __init__(self):
        super().__init__()
        self.word = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(SEQ, HIDDEN)

    def forward(self, inputs):
        tokens, positions = inputs
        return self.word(tokens) + self.position(positions)


def project_to_vocabulary(embedding, hidden):
    return hidden @ embedding.word.weight.t()


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and MLP, causal (small, but the real operations)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, 2, batch_first=True, dropout=0.0)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def masked_cross_entropy(logits, labels):
    targets, loss_mask = labels
    losses = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1), reduction="none")
    return (losses * loss_mask.reshape(-1)).sum() / loss_mask.sum()


def batch_fn(data):
    """A dict of token ids to the pipeline's (inputs, labels), as pretrain_gpt.py's get_batch_pipe does."""
    text = data["text"]
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    loss_mask = (tokens != 0).float()
    return (tokens, positions), (labels, loss_mask)


def specs():
    return ([TiedLayerSpec("embed", TokenEmbedding, tied_weight_attr=["word.weight"])]
            + [LayerSpec(TransformerBlock) for _ in range(BLOCKS)]
            + [LayerSpec(nn.LayerNorm, HIDDEN),
               TiedLayerSpec("embed", TokenEmbedding, forward_fn=project_to_vocabulary, tied_weight_attr=["word.weight"])])


def _int_seed_shim():
    """DeepSpeed's PipelineModule with ``seed_layers=True`` and a ``type:`` cut seeds each layer with a numpy
    integer (its cut is a numpy array), which Python 3.11's ``random.seed`` refuses: a DeepSpeed bug that has
    nothing to do with schedules. The seed is passed on as an int, for the stock engine and ours alike."""
    from deepspeed.runtime import utils
    from deepspeed.runtime.pipe import module as pipe_module
    seed_fn = utils.set_random_seed
    if not getattr(seed_fn, "int_shim", False):
        def set_random_seed(seed):
            return seed_fn(int(seed))
        set_random_seed.int_shim = True
        pipe_module.ds_utils.set_random_seed = set_random_seed


def build_module(stages):
    _int_seed_shim()
    return PipelineModule(layers=specs(), num_stages=stages, loss_fn=masked_cross_entropy,
                          partition_method="type:transformer", seed_layers=True, base_seed=BASE_SEED)


def param_groups(module):
    """Weight decay on matrices, none on biases and norms (Megatron's split), by parameter name."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name or p.dim() == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1, "wd_mult": 1.0, "lr_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0}]


def scheduler(optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2 * 16,
                                   lr_decay_steps=8 * 16, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                   wd_incr_steps=8 * 16, wd_incr_style="constant")


def config(schedule, micro_batches, dp=1, **options):
    cfg = {"train_batch_size": micro_batches * MICRO * dp, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": 0.0, "steps_per_print": 10 ** 6}
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule, "timeout": 60, **options}
    return cfg


def build_engine(stages, cfg):
    torch.manual_seed(7)               # what the script's own initialisation would leave
    module = build_module(stages)
    optimizer = torch.optim.AdamW(param_groups(module), lr=3e-3, betas=(0.9, 0.95))
    engine, _, _, lr_scheduler = deepspeed.initialize(model=module, optimizer=optimizer,
                                                      lr_scheduler=scheduler(optimizer), config=cfg)
    engine.set_batch_fn(batch_fn)
    return engine, lr_scheduler


def token_batches(step, count, dp, dp_id):
    """This data-parallel rank's ``count`` micro-batches of step ``step``, as dicts (the script's loader)."""
    g = torch.Generator().manual_seed(1000 + step)
    text = torch.randint(1, VOCAB, (count * dp, MICRO, SEQ + 1), generator=g)
    return [{"text": text[dp_id * count + i]} for i in range(count)]


def train(engine, micro_batch_counts, dp=1):
    """One train_batch per entry, set_train_batch_size before each (the script's ramp-up call)."""
    losses, lrs, set_size_s = [], [], []
    dp_id = engine.grid.get_data_parallel_id()
    for step, count in enumerate(micro_batch_counts):
        start = time.perf_counter()
        engine.set_train_batch_size(count * MICRO * dp)
        set_size_s.append(time.perf_counter() - start)
        loss = engine.train_batch(data_iter=iter(token_batches(step, count, dp, dp_id)))
        losses.append(float(loss))
        lrs.append(engine.get_lr()[0])
    return losses, lrs, set_size_s


def compare(schedule, stages=4, dp=1, counts=(8,) * STEPS, **options):
    """Stock and ``schedule`` on the same script: losses, learning rates, and what set_train_batch_size cost."""
    stock, _ = build_engine(stages, config(None, counts[0], dp))
    stock_losses, stock_lrs, stock_set = train(stock, counts, dp)
    del stock
    engine, lr_scheduler = build_engine(stages, config(schedule, counts[0], dp, **options))
    moved = getattr(lr_scheduler, "optimizer", None) is getattr(engine.optimizer, "optimizer", engine.optimizer) \
        or lr_scheduler.optimizer.param_groups is engine.optimizer.param_groups
    built_before = len(getattr(engine, "_train_plans", {}))
    losses, lrs, set_size_s = train(engine, counts, dp)
    return {"stock_losses": stock_losses, "losses": losses, "stock_lrs": stock_lrs, "lrs": lrs,
            "schedule": engine.schedule.name, "scheduler_moved": bool(moved),
            "plans_built": len(getattr(engine, "_train_plans", {})) - built_before,
            "set_size_same_n_s": max(s for s, prev, n in zip(set_size_s[1:], counts, counts[1:]) if prev == n),
            "stock_set_size_s": max(stock_set)}


def stock_checkpoint_resume(schedule, **options):
    """Two steps under stock, saved; a schedule resumes from that checkpoint, and must continue exactly as stock
    resuming from it does (weights, AdamW moments and the scheduler's step count all carried)."""
    holder = [tempfile.mkdtemp(prefix="dsc_gpt_ckpt_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    root = holder[0]
    first = [8, 8]
    stock, _ = build_engine(4, config(None, 8))
    train(stock, first)
    stock.save_checkpoint(root, tag="stock")
    del stock
    later = [8, 8]

    def resumed(schedule_name, **opts):
        engine, _ = build_engine(4, config(schedule_name, 8, **opts))
        engine.load_checkpoint(root, tag="stock")
        losses, lrs, _ = [], [], None
        for step, count in enumerate(later, start=len(first)):
            engine.set_train_batch_size(count * MICRO)
            losses.append(float(engine.train_batch(data_iter=iter(token_batches(step, count, 1, 0)))))
            lrs.append(engine.get_lr()[0])
        return losses, lrs
    stock_losses, stock_lrs = resumed(None)
    losses, lrs = resumed(schedule, **options)
    tdist.barrier()
    if tdist.get_rank() == 0:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return {"stock_losses": stock_losses, "losses": losses, "stock_lrs": stock_lrs, "lrs": lrs}


def auto_without_data(counts=(8,) * STEPS, load_stock=False):
    """"schedule": "auto" with no training_data: planned at the first train_batch from its first micro-batch. The
    run must equal the one naming the chosen section from the start bit for bit, and stock to float rounding."""
    root = None
    if load_stock:
        holder = [tempfile.mkdtemp(prefix="dsc_gpt_auto_") if tdist.get_rank() == 0 else None]
        tdist.broadcast_object_list(holder, src=0)
        root = holder[0]
        stock, _ = build_engine(4, config(None, counts[0]))
        train(stock, counts[:1])
        stock.save_checkpoint(root, tag="stock")
        del stock

    def run(schedule, **options):
        engine, _ = build_engine(4, config(schedule, counts[0], **options))
        if root:
            engine.load_checkpoint(root, tag="stock")
        return engine, train(engine, counts)
    stock, (stock_losses, stock_lrs, _) = run(None)
    del stock
    auto, (losses, lrs, _) = run("auto", memory_limit_gb=64)
    chosen = dict(auto.auto_decision["pipeline"])
    planned = {"schedule": auto.schedule.name, "engine_class": type(auto).__name__,
               "deferred": auto._deferred_plan is not None}
    del auto
    name = chosen.pop("schedule")
    named, (named_losses, named_lrs, _) = run(name, **chosen)
    del named
    if root and tdist.get_rank() == 0:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return {"stock_losses": stock_losses, "losses": losses, "named_losses": named_losses, "stock_lrs": stock_lrs,
            "lrs": lrs, "named_lrs": named_lrs, "chosen": {"schedule": name, **chosen}, **planned}


def auto_resumes_own_checkpoint(schedule="interleaved", **options):
    """A ds_chimera checkpoint loaded under "auto" before its first call: the run goes on under the plan the
    checkpoint was written under (schedule, options, cut), exactly as the uninterrupted named run."""
    holder = [tempfile.mkdtemp(prefix="dsc_gpt_own_") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(holder, src=0)
    root = holder[0]
    named, _ = build_engine(4, config(schedule, 8, **options))
    train(named, [8, 8])
    named.save_checkpoint(root, tag="named")
    dp_id = named.grid.get_data_parallel_id()
    reference = [float(named.train_batch(data_iter=iter(token_batches(step, 8, 1, dp_id)))) for step in (2, 3)]
    del named
    auto, _ = build_engine(4, config("auto", 8, memory_limit_gb=64))
    auto.load_checkpoint(root, tag="named")
    losses = [float(auto.train_batch(data_iter=iter(token_batches(step, 8, 1, dp_id)))) for step in (2, 3)]
    result = {"reference": reference, "losses": losses, "schedule": auto.schedule.name,
              "options": dict(auto.plan.config.options), "deferred": auto._deferred_plan is not None}
    tdist.barrier()
    if tdist.get_rank() == 0:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return result


class NoGradRefusingBlock(TransformerBlock):
    """Refuses to run without autograd: the profiler's forward-only timing fails on it (training would not)."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            raise RuntimeError("this block runs with autograd only")
        return super().forward(x)


def auto_profile_error():
    """A layer rank 0 cannot profile: the error reaches every rank as a ValueError (none waits for rank 0)."""
    _int_seed_shim()
    layers = specs()
    layers[3] = LayerSpec(NoGradRefusingBlock)
    module = PipelineModule(layers=layers, num_stages=4, loss_fn=masked_cross_entropy,
                            partition_method="type:transformer", seed_layers=True, base_seed=BASE_SEED)
    optimizer = torch.optim.AdamW(param_groups(module), lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           config=config("auto", 8, memory_limit_gb=64))
    engine.set_batch_fn(batch_fn)
    try:
        engine.train_batch(data_iter=iter(token_batches(0, 8, 1, 0)))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


SCHEDULES = {"1f1b": {}, "gpipe": {}, "chimera": {}, "zbv": {}, "interleaved": {"chunks": 2},
             "breadth-first": {"chunks": 2}, "zb-h1": {}, "dualpipev": {}}
SCENARIOS = {f"gpt-{name}": (lambda name=name, opts=opts: compare(name, **opts)) for name, opts in SCHEDULES.items()}
# batch-size ramp-up: N changes every few steps, back to a count already built
SCENARIOS["gpt-rampup-chimera"] = lambda: compare("chimera", counts=(4, 4, 8, 8, 4, 8))
SCENARIOS["gpt-rampup-zbv"] = lambda: compare("zbv", counts=(4, 8, 8, 4))
# a 1-stage PipelineModule (pure data parallelism, DeepSpeed's test_pipe_base shape) under Chimera
SCENARIOS["gpt-1stage-chimera"] = lambda: compare("chimera", stages=1, dp=4, counts=(2,) * 3)
SCENARIOS["gpt-stock-ckpt-1f1b"] = lambda: stock_checkpoint_resume("1f1b")
SCENARIOS["gpt-auto"] = auto_without_data
SCENARIOS["gpt-auto-profile-error"] = auto_profile_error
SCENARIOS["gpt-auto-stock-ckpt"] = lambda: auto_without_data(counts=(8, 8), load_stock=True)
SCENARIOS["gpt-stock-ckpt-chimera"] = lambda: stock_checkpoint_resume("chimera")
SCENARIOS["gpt-stock-ckpt-zbv"] = lambda: stock_checkpoint_resume("zbv")
SCENARIOS["gpt-auto-own-ckpt"] = lambda: auto_resumes_own_checkpoint("interleaved", chunks=2)


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    run_scenarios(SCENARIOS, sys.argv[1], sys.argv[2].split(","))


if __name__ == "__main__":
    main()
