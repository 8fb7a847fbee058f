"""Megatron-Core's forward-backward contract, run by ds_chimera's lowered schedules.

``get_forward_backward_func("chimera")`` returns a function that Megatron's training loop can
call where it calls ``megatron.core.pipeline_parallel.get_forward_backward_func()``'s. The
same :class:`~ds_chimera.runtime.executor.StepExecutor` as the DeepSpeed engine runs the
rank's lowered program; only the chunk call and the loss follow Megatron's conventions:

- before each forward the chunk gets its input through ``set_input_tensor``, then
  ``forward_step_func(data_iterator, chunk)`` returns ``(output, loss_func)``;
- on a loss stage ``loss_func(output)`` returns ``(loss, reduced)`` (loss divided by the
  number of micro-batches) or ``(loss, num_tokens, reduced)`` (divided by the tokens too,
  unless ``config.calculate_per_token_loss``), exactly as Megatron does;
- the function returns the ``reduced`` dicts in micro-batch order on the last pipeline rank
  and ``[]`` elsewhere, as Megatron's schedules do, wherever the schedule computes the loss
  (Chimera on two ranks, zbv on rank 0); the loss is divided in place, as Megatron does, so
  a dict holding a view of it reports what Megatron's own schedule would;
- after the backward it calls ``config.finalize_model_grads_func`` as Megatron does. The
  gradient sync a schedule adds (Chimera's replicas) is done here, in the bubbles.

Micro-batch ``mb`` is the ``mb``-th item of the chunk's data iterator, whatever order the
schedule runs it in. Every iterator a forward reads from advances by exactly
``num_microbatches`` per call. Communication goes through ``torch.distributed`` with the
pipeline group's ranks: gloo on CPU, NCCL on GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pickle

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ..runtime import faults
from ..runtime.executor import StepExecutor
from ..runtime.gradsync import FlatGradAllReduce
from ..runtime.groups import PipelineGroups
from ..runtime.p2p import LOSS_TAG, P2P, post_or_fail, wait_or_fail
from ..runtime.plan import DEFAULT_TIMEOUT_S, proven_programs
from ..runtime.tensors import to_device
from ..schedules import registry
from ..schedules.actions import split_chunks
from ..validation import check_seconds
from .stages import make_schedule, pipeline_group


@dataclasses.dataclass
class _DefaultConfig:
    """What Megatron's ModelParallelConfig provides, for chunks that carry no ``config``."""
    finalize_model_grads_func: object = None
    grad_scale_func: object = None
    no_sync_func: object = None
    calculate_per_token_loss: bool = False
    enable_autocast: bool = False
    autocast_dtype: object = None


def _unwrap(module):
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def _model_config(chunk):
    for module in (chunk, _unwrap(chunk)):
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "finalize_model_grads_func"):
            return config
    return _DefaultConfig()


class _MicroBatchFeed:
    """Hands micro-batch ``mb`` of one data iterator to whichever forward asks, in any order."""

    def __init__(self, source, count: int):
        self.source, self.count, self.items, self.used = source, count, [], False

    def item(self, mb: int):
        self.used = True
        while len(self.items) <= mb:
            try:
                self.items.append(next(self.source))
            except StopIteration:
                raise RuntimeError(f"ds_chimera: the data iterator ran out after {len(self.items)} micro-batches; "
                                   f"this call needs {self.count}") from None
        return self.items[mb]

    def finish(self) -> None:
        """Keep iterators aligned across calls: a used iterator advances by exactly ``count``."""
        if self.used and len(self.items) < self.count:
            self.item(self.count - 1)


class _OneMicroBatch:
    """The iterator ``forward_step_func`` receives: one ``next()`` gives its micro-batch."""

    def __init__(self, feed: _MicroBatchFeed, mb: int):
        self.feed, self.mb, self.taken = feed, mb, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken:
            raise RuntimeError(f"ds_chimera: forward_step_func called next(data_iterator) twice for micro-batch "
                               f"{self.mb}; each forward gets exactly one micro-batch")
        self.taken = True
        return self.feed.item(self.mb)


class MegatronHost:
    """The executor's context for one call (see :class:`~ds_chimera.runtime.context.ExecutionContext`):
    chunks, data, Megatron's loss bookkeeping, Chimera's replica syncs. Clipping and the
    optimizer step are the caller's (Megatron's training loop), so the program's CLIP and
    STEP are no-ops here."""

    def __init__(self, runner, schedule, chunks, feeds, config, forward_step_func, num_microbatches,
                 collect_non_loss_data, train: bool):
        placement = schedule.placement
        self.placement, self.pipe_rank = placement, runner.rank
        local = placement.chunks_on(runner.rank)
        self.chunk_modules = dict(zip(local, chunks))
        self.feeds = dict(zip(local, feeds))
        self.split_chunks = split_chunks(schedule.orders[runner.rank]) if train else set()
        self.transport = runner.p2p
        self.groups = runner.groups
        self.config, self.forward_step_func = config, forward_step_func
        self.num_microbatches, self.collect_non_loss_data = num_microbatches, collect_non_loss_data
        self.train = train
        self.loss_func = None
        self.started: set = set()       # chunks that ran their first forward of this call
        self.grad_scale = 1.0
        self.reduced: dict = {}         # micro-batch -> what loss_func reported
        self.num_tokens = torch.zeros((), dtype=torch.int64)
        self.pending: list = []
        self.timeout_s = runner.timeout_s
        self.cp_size = _context_parallel_size()

    def load_input(self, chunk: int, mb: int):
        return ()             # first stages read their data in forward_step_func; set_input_tensor([None])

    def forward(self, c: int, mb: int, x, capture, train: bool):
        chunk = self.chunk_modules[c]
        inputs = (list(x) or [None]) if isinstance(x, tuple) else [x]     # first stages: [None], as Megatron
        set_input_tensor = getattr(_unwrap(chunk), "set_input_tensor", None)
        if set_input_tensor is None:
            raise TypeError(f"model chunk {type(_unwrap(chunk)).__name__} has no set_input_tensor(); Megatron's "
                            f"contract passes each stage's input that way")
        set_input_tensor(inputs)
        feed = self.feeds[c]
        data = _OneMicroBatch(feed, mb) if feed is not None else None
        autocast = contextlib.nullcontext()
        if getattr(self.config, "enable_autocast", False):
            autocast = torch.autocast(next(chunk.parameters()).device.type, dtype=self.config.autocast_dtype)
        if c not in self.started and hasattr(_unwrap(chunk), "set_is_first_microbatch"):
            _unwrap(chunk).set_is_first_microbatch()        # FP8 layers recast their weights once per call
        self.started.add(c)
        with autocast, _blocks_of(chunk, capture) as nodes:
            output, loss_func = self.forward_step_func(data, chunk)
        if capture is not None:
            _settle_blocks(chunk, capture, nodes, output)
        self.loss_func = loss_func
        self._set_auxiliary_loss_scales(output)
        return output

    def _set_auxiliary_loss_scales(self, output) -> None:
        """MoE and multi-token-prediction losses are scaled as the main loss, as Megatron does after each forward."""
        config = self.config
        moe = getattr(config, "num_moe_experts", None) is not None
        mtp = getattr(config, "mtp_num_layers", None) is not None
        if not (moe or mtp) or not self.train:
            return
        device = output.device if isinstance(output, torch.Tensor) else None
        scale = self.grad_scale * torch.ones(1, device=device)
        per_token = getattr(config, "calculate_per_token_loss", False)
        if moe:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
            MoEAuxLossAutoScaler.set_loss_scale(scale if per_token else scale * self.cp_size / self.num_microbatches)
        if mtp:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
            MTPLossAutoScaler.set_loss_scale(scale if per_token else scale / self.num_microbatches)

    def loss(self, output, chunk: int, mb: int):
        """Megatron's loss bookkeeping for the forward that just ran on a loss stage."""
        loss_func, self.loss_func = self.loss_func, None
        if loss_func is None:
            if self.train:
                raise ValueError("forward_step_func returned no loss_func on a loss stage; training needs one")
            self.reduced[mb] = output
            return output
        if self.collect_non_loss_data:        # forward-only: __call__ refuses it in training
            self.reduced[mb] = loss_func(output, non_loss_data=True)
            return output
        outputs = loss_func(output)
        # in place, as Megatron's forward_step_calc_loss: a reduced dict holding a view of the loss
        # (loss.detach()) then reports what Megatron's own schedule reports
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            if getattr(self.config, "calculate_per_token_loss", False):
                self.num_tokens += torch.as_tensor(num_tokens).detach().cpu().to(torch.int64)
            else:
                loss /= torch.clamp(torch.as_tensor(num_tokens, device=loss.device), min=1)
                loss /= self.num_microbatches
        elif len(outputs) == 2:
            loss, reduced = outputs
            loss *= self.cp_size
            loss /= self.num_microbatches
        else:
            raise ValueError(f"loss_func must return (loss, reduced) or (loss, num_tokens, reduced); "
                             f"got {len(outputs)} values")
        self.reduced[mb] = reduced
        return loss

    # ---- Chimera's replica gradient all-reduce, posted by the program's GradSync -------------
    @staticmethod
    def _grad(p):
        if getattr(p, "main_grad", None) is not None:      # Megatron DDP's buffers
            return p.main_grad
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def backward_done(self, chunk: int, mb: int) -> None:
        pass

    def start_grad_sync(self, stage: int) -> None:
        group = self.groups.stage.get(stage)
        if group is None:
            return
        chunk = next(m for c, m in self.chunk_modules.items() if self.placement.chunks[c].stage == stage)
        params = [p for p in chunk.parameters() if p.requires_grad]
        if not params:
            return
        self.pending.append(FlatGradAllReduce([self._grad(p) for p in params], group, f"stage {stage}'s replicas"))

    def wait_grad_syncs(self, stages: tuple) -> None:
        for sync in self.pending:
            sync.finish(self.timeout_s)
        self.pending = []

    def clip_gradients(self, scope, stage: int) -> None:
        pass                  # Megatron's optimizer clips (over its own model-parallel groups)

    def optimizer_step(self, chunks: tuple) -> None:
        pass                  # the caller steps after forward_backward_func returns

    def gather_weights(self, chunk: int) -> None:
        raise ValueError("sharded data parallelism (ZeRO-2/3) runs on the DeepSpeed engine only")

    wait_weights = release_weights = prepare_grads = gather_weights


def _pipeline_groups(placement, pp_ranks: list, nccl: bool, timeout_s: float) -> PipelineGroups:
    """The replica (and NCCL edge) groups of every pipeline group of the world, each within its pipeline."""
    replicated = [s for s in range(placement.num_stages) if len(placement.stage_group(s)) > 1]
    if not replicated and not nccl:
        return PipelineGroups(placement, [pp_ranks], 0, timeout_s, stages=[])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(pp_ranks))
    pipelines = sorted({tuple(r) for r in everyone})
    return PipelineGroups(placement, pipelines, pipelines.index(tuple(pp_ranks)), timeout_s, stages=replicated,
                          nccl_edges=nccl)


@contextlib.contextmanager
def _blocks_of(chunk, capture):
    """For a split backward: record each parameter-owning module's output as one block.

    The weight-gradient pass then differentiates each module from its own output to its
    own parameters. Parameters no module owns directly get their gradients with the input
    gradients (a block without output), and so do parameters that the autograd graph shows
    used outside their module's recorded call (tied weights, a second call): per-module W
    would miss those uses.
    """
    if capture is None:
        yield None
        return
    owners = [m for m in chunk.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    nodes: list = []          # per capture entry: the grad_fns of its outputs when recorded

    def record(module, args, output):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        # graph outputs only: a parameter handed back (Megatron's skip_bias_add bias) is not one
        outs = tuple(t for t in tree_leaves(output)
                     if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None)
        if outs:
            capture.append((outs, params, tuple(t._version for t in outs)))
        else:
            capture.append((None, params))
        nodes.append(tuple(t.grad_fn for t in outs))

    handles = [m.register_forward_hook(record) for m in owners]
    try:
        yield nodes
    finally:
        for handle in handles:
            handle.remove()


def _settle_blocks(chunk, capture: list, nodes: list, output) -> None:
    """Move every parameter per-module W would get wrong to the input-gradient pass.

    Walks the autograd graph from the chunk's output and from each block's output; a walk
    stops at other blocks' outputs. A parameter reached from the chunk's output, or from a
    block that does not own it, is used outside its owner's recorded output.
    """
    boundary = {}
    for i, grad_fns in enumerate(nodes):
        for node in grad_fns:
            if node is not None:
                boundary.setdefault(node, set()).add(i)
    used_elsewhere = set()

    def walk(starts, owner):
        stack, seen = list(starts), set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in boundary and owner not in boundary[node]:
                continue                                   # another block's output: its own walk covers it
            variable = getattr(node, "variable", None)      # AccumulateGrad: a parameter
            if variable is not None:
                if owner is None or id(variable) not in owned[owner]:
                    used_elsewhere.add(id(variable))
                continue
            stack.extend(next_node for next_node, _ in node.next_functions)

    owned = [{id(p) for p in block[1]} for block in capture]
    walk([t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor)], None)
    for i, grad_fns in enumerate(nodes):
        starts = [next_node for node in grad_fns if node is not None for next_node, _ in node.next_functions]
        walk(starts, i)
    for i, block in enumerate(capture):
        if block[0] is not None and any(id(p) in used_elsewhere for p in block[1]):
            capture[i] = (block[0], [p for p in block[1] if id(p) not in used_elsewhere]) + tuple(block[2:])
    owned_ids = {id(p) for block in capture for p in block[1]}     # what moved out joins the unowned rest
    rest = [p for p in chunk.parameters() if p.requires_grad and id(p) not in owned_ids]
    if rest:
        capture.append((None, rest))


def _megatron_layout(chunk, num_stages: int):
    """(stage, description) of a Megatron chunk from its layers' global numbers, or None if unknown."""
    config = getattr(chunk, "config", None)
    total = getattr(config, "num_layers", None)
    numbers = sorted({m.layer_number for m in chunk.modules()
                      if type(m).__name__.endswith("TransformerLayer") and isinstance(getattr(m, "layer_number", None), int)})
    if not numbers or not total or total % num_stages:
        return None
    per_stage = total // num_stages
    parts = [f"decoder layers {numbers[0]}-{numbers[-1]}"]
    if getattr(chunk, "pre_process", False):
        parts.insert(0, "the embedding")
    if getattr(chunk, "post_process", False):
        parts.append("the output layer")
    return (numbers[0] - 1) // per_stage, ", ".join(parts)


def _check_split_backward(schedule, config, rank: int) -> None:
    """Configurations whose backward cannot be split into input- and weight-gradient passes."""
    if not split_chunks(schedule.orders[rank]):
        return
    for flag in ("gradient_accumulation_fusion", "fuse_wgrad_accumulation"):
        if getattr(config, flag, False):
            raise ValueError(f"schedule {schedule.name!r} splits the backward into input and weight gradients, but "
                             f"{flag}=True adds weight gradients during the input pass (they would count twice); "
                             f"set {flag}=False or use a schedule without a split backward")
    if getattr(config, "recompute_granularity", None):
        raise ValueError(f"schedule {schedule.name!r} splits the backward, which Megatron's activation recompute "
                         f"(recompute_granularity={config.recompute_granularity!r}) does not allow; turn recompute "
                         f"off or use a schedule without a split backward")


def _context_parallel_size() -> int:
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_context_parallel_world_size()
    except Exception:      # Megatron absent or not initialised: no context parallelism
        pass
    return 1


class ScheduleRunner:
    """One schedule behind Megatron's contract; caches programs and groups per pipeline shape."""

    def __init__(self, name: str, options: dict, timeout_s: float):
        self.name, self.options, self.timeout_s = name, dict(options), timeout_s
        self._programs: dict = {}
        self._comms: dict = {}
        self._shapes: dict = {}
        self.rank = None
        self.p2p = None
        self.groups = None

    def _schedule(self, size: int, num_microbatches: int):
        key = (size, num_microbatches)
        if key not in self._programs:
            schedule = make_schedule(self.name, size, num_microbatches, self.options)
            self._programs[key] = (schedule, *proven_programs(schedule))
        return self._programs[key]

    def _communication(self, schedule, group, device):
        ranks = (dist.get_process_group_ranks(group) if group is not dist.group.WORLD
                 else list(range(dist.get_world_size())))
        key = (tuple(ranks), tuple(map(tuple, schedule.placement.stage_ranks)), str(device))
        if key not in self._comms:
            nccl = dist.get_backend(group) != "gloo"
            groups = _pipeline_groups(schedule.placement, ranks, nccl, self.timeout_s)
            p2p = P2P(lambda p: ranks[p], device, len(schedule.placement.chunks), self.timeout_s, groups.edges)
            p2p.shape_hint = "set variable_seq_lengths=True in the model's config (Megatron's switch for this)"
            self._comms[key] = (groups, p2p)
        return self._comms[key]

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 decoder_seq_length=None, forward_only=False, collect_non_loss_data=False, first_val_step=None,
                 adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None, force_all_reduce=False):
        # seq_length, micro_batch_size, decoder_seq_length, adjust_tensor_shapes_fn: Megatron needs them to
        # size its receive buffers; ds_chimera's messages carry their shapes. first_val_step is for FP8.
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if collect_non_loss_data and not forward_only:
            raise ValueError("collect_non_loss_data=True needs forward_only=True (Megatron collects it in evaluation)")
        group = pg_collection.pp if pg_collection is not None and getattr(pg_collection, "pp", None) is not None \
            else pipeline_group()
        size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        schedule, program, eval_program = self._schedule(size, num_microbatches)
        placement = schedule.placement
        local = placement.chunks_on(self.rank)
        self._check_chunks(chunks, local, placement)
        sources = self._sources(data_iterator, len(chunks))
        feeds, shared = [], {}
        for source in sources:
            if source is None:
                feeds.append(None)
            else:
                feeds.append(shared.setdefault(id(source), _MicroBatchFeed(source, num_microbatches)))
        device = next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))
        self.groups, self.p2p = self._communication(schedule, group, device)
        config = _model_config(chunks[0])
        # as Megatron: fixed shapes (one header per edge) unless the config says they vary
        self.p2p.dynamic_shapes = bool(getattr(config, "variable_seq_lengths", False))
        train = not forward_only
        step = MegatronHost(self, schedule, chunks, feeds, config, forward_step_func, num_microbatches,
                            collect_non_loss_data, train)
        if train:
            _check_split_backward(schedule, config, self.rank)
        shapes = (seq_length, micro_batch_size, decoder_seq_length)
        if shapes != self._shapes.get(id(self.p2p)):
            # Megatron sizes its buffers from these arguments: new ones may mean new tensor shapes
            self.p2p.sent_meta.clear()
            self.p2p.recv_meta.clear()
            self._shapes[id(self.p2p)] = shapes
        scale = 1.0
        if train and config.grad_scale_func is not None:
            scale = config.grad_scale_func(torch.ones(1, device=device))
        step.grad_scale = scale
        with faults.guard(f"forward_backward_func ({self.name}, {'train' if train else 'forward only'})",
                          self.timeout_s):
            return self._run(step, program if train else eval_program, train, scale, config, chunks, shared,
                             placement, group, device, pg_collection, force_all_reduce)

    def _run(self, step, program, train, scale, config, chunks, feeds, placement, group, device, pg_collection,
             force_all_reduce):
        """One call's work, after every check: the program, the loss exchange, Megatron's gradient finalisation."""
        no_sync = config.no_sync_func if train and config.no_sync_func is not None else contextlib.nullcontext
        with contextlib.ExitStack() as stack:
            for func in (no_sync if isinstance(no_sync, list) else [no_sync]):
                stack.enter_context(func())
            StepExecutor(step).run(program.ops[self.rank], train=train, scale=scale, device=device)
        for feed in feeds.values():
            feed.finish()
        finish_losses = self._start_loss_exchange(step, placement, group, device)
        if train:
            num_tokens = None
            if getattr(config, "calculate_per_token_loss", False):
                # tokens are counted wherever a loss stage ran (two ranks under Chimera)
                total = step.num_tokens.to(device)        # NCCL reduces device tensors only
                wait_or_fail(lambda: dist.all_reduce(total, group=group, async_op=True), self.timeout_s,
                             "the token-count all-reduce")
                num_tokens = total
            if config.finalize_model_grads_func is not None:
                config.finalize_model_grads_func(chunks, num_tokens, pg_collection=pg_collection,
                                                 force_all_reduce=force_all_reduce)
        return finish_losses()

    @staticmethod
    def _sources(data_iterator, count: int) -> list:
        if isinstance(data_iterator, (list, tuple)):
            if len(data_iterator) != count:
                raise ValueError(f"data_iterator is a list of {len(data_iterator)} iterators, but this rank has "
                                 f"{count} model chunk(s); give one per chunk (Megatron's convention) or one in all")
            return list(data_iterator)
        return [data_iterator] * count

    def _build_hint(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"ds_chimera.megatron.build_model_chunks(model_provider, {self.name!r}{options})"

    def _check_chunks(self, chunks, local, placement) -> None:
        """Each chunk must hold the stage the schedule puts there, before the first forward.

        Chunks built by ``build_model_chunks`` carry their stage; chunks Megatron built itself
        (its virtual-pipeline layout: stage v*D + r on rank r) are read from their layers'
        global numbers, embedding and output layer.
        """
        stages = [placement.chunks[c].stage for c in local]
        if len(chunks) != len(local):
            raise ValueError(f"schedule {self.name!r} puts {len(local)} chunk(s) on pipeline rank {self.rank} "
                             f"(stages {stages}), but model has {len(chunks)}; build them with "
                             f"{self._build_hint()}")
        if placement.num_stages > 1 and any(getattr(_unwrap(c), "share_embeddings_and_output_weights", False)
                                            for c in chunks):
            raise ValueError("model chunks share the embedding and output weights (share_embeddings_and_output_weights"
                             "=True): ds_chimera's Megatron adapter does not sync a weight tied across stages yet; "
                             "build the model with untied embeddings")
        for i, (chunk, stage) in enumerate(zip(chunks, stages)):
            tagged = getattr(chunk, "_ds_chimera_stage", getattr(_unwrap(chunk), "_ds_chimera_stage", None))
            if tagged is not None:
                if tagged != stage:
                    name, options = getattr(chunk, "_ds_chimera_built_for", (None, {}))
                    built = f" (built for {name!r} with {options or 'no options'})" if name else ""
                    raise ValueError(f"model chunk {i} holds stage {tagged}{built}, but schedule {self.name!r} "
                                     f"with {self.options or 'no options'} puts stage {stage} there (pipeline rank "
                                     f"{self.rank} holds stages {stages}); build the chunks with the function's "
                                     f"schedule and options: {self._build_hint()}")
                continue
            found = _megatron_layout(_unwrap(chunk), placement.num_stages)
            if found is not None and found[0] != stage:
                held, what = found
                raise ValueError(f"model chunk {i} on pipeline rank {self.rank} holds {what}: stage {held} of "
                                 f"{placement.num_stages} (as Megatron's own virtual-pipeline layout puts stage "
                                 f"v*D + r on rank r), but schedule {self.name!r} puts stage {stage} there (this rank "
                                 f"holds stages {stages}); build the chunks with {self._build_hint()}")

    def _start_loss_exchange(self, step, placement, group, device):
        """Post the hand-over of per-micro-batch results to the last pipeline rank; return a function that
        finishes it and gives them in order there (``[]`` on every other rank), as Megatron's schedules do.

        Megatron's training loop reads the results on its last pipeline stage. A schedule may compute
        losses elsewhere (Chimera on two ranks, zbv's last stage on rank 0), so the loss ranks send
        theirs to rank D-1: sizes now (overlapping Megatron's gradient finalisation), then the
        pickled results. Tensors that arrive are detached: they cannot carry a graph across ranks.
        """
        loss_ranks = sorted({placement.rank_of(c.index) for c in placement.chunks
                             if placement.next_chunk(c.index) is None})
        last = placement.num_ranks - 1
        senders = [r for r in loss_ranks if r != last]
        local = lambda: [step.reduced[mb] for mb in sorted(step.reduced)]      # noqa: E731
        if self.rank != last and self.rank not in senders:
            return list
        if not senders:
            return local
        # CPU copies travel: pickled device tensors would be rebuilt on the sender's device index
        on = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        peer = (lambda r: r) if group is None or group is dist.group.WORLD else \
            (lambda r: dist.get_global_rank(group, r))
        what = "the loss results for the last pipeline rank"
        if self.rank != last:
            payload = torch.frombuffer(bytearray(pickle.dumps(to_device(_detached(step.reduced), torch.device("cpu")))),
                                       dtype=torch.uint8).to(on)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=on)
            works = [post_or_fail(lambda: dist.isend(size, peer(last), group=group, tag=LOSS_TAG), what),
                     post_or_fail(lambda: dist.isend(payload, peer(last), group=group, tag=LOSS_TAG + 1), what)]

            def sent() -> list:
                for work in works:
                    wait_or_fail(work, self.timeout_s, what)
                return []
            return sent
        sizes = {r: torch.zeros(1, dtype=torch.int64, device=on) for r in senders}
        size_works = {r: post_or_fail(lambda r=r: dist.irecv(sizes[r], peer(r), group=group, tag=LOSS_TAG),
                                      f"the size of rank {r}'s loss results") for r in senders}

        def finish() -> list:
            merged = dict(step.reduced)
            for r in senders:
                wait_or_fail(size_works[r], self.timeout_s, f"the size of pipeline rank {r}'s loss results")
                data = torch.empty(int(sizes[r].item()), dtype=torch.uint8, device=on)
                wait_or_fail(lambda: dist.irecv(data, peer(r), group=group, tag=LOSS_TAG + 1), self.timeout_s,
                             f"the loss results of pipeline rank {r}")
                merged.update(pickle.loads(data.cpu().numpy().tobytes()))
            return [to_device(merged[mb], device) for mb in sorted(merged)]
        return finish


def _detached(x):
    """``x`` with its tensors detached (inside dicts, lists and tuples too)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    return x


def get_forward_backward_func(schedule: str = "1f1b", *, timeout: float = DEFAULT_TIMEOUT_S, **options):
    """A function with Megatron-Core's forward-backward contract that runs ``schedule``.

    ``options`` are the schedule's own (``chunks=V`` for interleaved and breadth-first,
    ``pipelines`` for chimera...). ``timeout`` (seconds) bounds every wait on a peer: a dead
    rank becomes a clear error. Bad names and options fail here, before any step.
    """
    registry.checked(schedule, options, caller_steps=True)
    runner = ScheduleRunner(schedule, options, check_seconds("get_forward_backward_func", "timeout", timeout))

    def forward_backward_func(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                              micro_batch_size, decoder_seq_length=None, forward_only=False,
                              collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
                              p2p_communicator=None, pg_collection=None, force_all_reduce=False):
        return runner(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                      num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                      decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                      collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                      adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
                      pg_collection=pg_collection, force_all_reduce=force_all_reduce)

    forward_backward_func.schedule = schedule
    forward_backward_func.options = dict(options)
    return forward_backward_func
