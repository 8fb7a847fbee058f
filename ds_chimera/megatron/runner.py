"""Megatron-Core's forward-backward contract, run by ds_chimera's lowered schedules.

``get_forward_backward_func("chimera")`` returns a function that Megatron's training loop can
call where it calls ``megatron.core.pipeline_parallel.get_forward_backward_func()``'s. The
same :class:`~ds_chimera.runtime.executor.StepExecutor` as the DeepSpeed engine runs the
rank's lowered program; only the chunk call and the loss follow Megatron's conventions
(:class:`~.host.MegatronHost`):

- before each forward the chunk gets its input through ``set_input_tensor``, then
  ``forward_step_func(data_iterator, chunk)`` returns ``(output, loss_func)``;
- on a loss stage ``loss_func(output)`` returns ``(loss, reduced)`` (loss divided by the
  number of micro-batches) or ``(loss, num_tokens, reduced)`` (divided by the tokens too,
  unless ``config.calculate_per_token_loss``), exactly as Megatron does;
- the function returns the ``reduced`` dicts in micro-batch order on the last pipeline rank
  and ``[]`` elsewhere, as Megatron's schedules do, wherever the schedule computes the loss
  (Chimera on two ranks, zbv on rank 0: :mod:`.loss_exchange`); the loss is divided in place,
  as Megatron does, so a dict holding a view of it reports what Megatron's own schedule would;
- after the backward it calls ``config.finalize_model_grads_func`` as Megatron does. The
  gradient sync a schedule adds (Chimera's replicas) is done here, in the bubbles.

Micro-batch ``mb`` is the ``mb``-th item of the chunk's data iterator, whatever order the
schedule runs it in. Every iterator a forward reads from advances by exactly
``num_microbatches`` per call. Communication goes through ``torch.distributed`` with the
pipeline group's ranks: gloo on CPU, NCCL on GPU. The chunks are checked before the first
forward (:mod:`.chunk_checks`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..config import PipelineConfig
from ..runtime import faults
from ..runtime.executor import StepExecutor
from ..runtime.groups import PipelineGroups, process_groups_in
from ..runtime.p2p import P2P, wait_or_fail
from ..runtime.plan import proven_programs
from ..schedules.lowering import without_global_clip
from .chunk_checks import check_chunks, check_split_backward
from .host import MegatronHost, MicroBatchFeed
from .loss_exchange import start_loss_exchange
from .model_chunk import model_config
from .stages import call_pipeline_group, chunks_device


def _pipeline_groups(placement, pp_ranks: list, nccl: bool, timeout_s: float) -> PipelineGroups:
    """The replica (and NCCL edge) groups of every pipeline group of the world, each within its pipeline."""
    replicated = placement.replicated_stages()
    if not replicated and not nccl:
        return PipelineGroups(placement, [pp_ranks], 0, timeout_s, stages=[])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(pp_ranks))
    pipelines = sorted({tuple(r) for r in everyone})
    return PipelineGroups(placement, pipelines, pipelines.index(tuple(pp_ranks)), timeout_s, stages=replicated,
                          nccl_edges=nccl)


REBUILD_GROUPS = ("rebuild Megatron's model-parallel groups to go on (parallel_state.destroy_model_parallel(), "
                  "then initialize_model_parallel())")


def _megatron_groups() -> list:
    """The process groups Megatron's parallel state holds (a failure breaks them; the script rebuilds them)."""
    from megatron.core import parallel_state
    return process_groups_in(parallel_state)


class PipelineShapeError(ValueError, RuntimeError):
    """A ``num_microbatches`` (or pipeline size) the schedule cannot run: Megatron's own schedules raise
    RuntimeError for it (its tests expect that), ds_chimera's checks ValueError; this is both."""


class ScheduleRunner:
    """One schedule behind Megatron's contract; caches programs and groups per pipeline shape."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.name, self.options, self.timeout_s = config.schedule, dict(config.options), config.timeout_s
        self._programs: dict = {}
        self._comms: dict = {}
        self._shapes: dict = {}
        self._checked: set = set()       # (chunks, shape, group) whose chunks every rank found fit
        self.rank = None
        self.p2p = None
        self.groups = None
        self.epoch = None                # the fault monitor's job these groups belong to
        self.trace_next = False          # time the next training call's actions ("auto" profiles with them)
        self.last_records: list = []     # (rank, kind, chunk, mb, start, end) of the traced call
        self.last_schedule = None

    def _schedule(self, size: int, num_microbatches: int):
        key = (size, num_microbatches)
        if key not in self._programs:
            try:
                schedule = self.config.build_schedule(size, num_microbatches)
            except ValueError as exc:
                raise PipelineShapeError(f"{exc} (num_microbatches={num_microbatches} on {size} pipeline ranks)") from None
            program, eval_program = proven_programs(schedule)
            # Megatron's optimizer clips over its own groups after the call: no global CLIP here
            self._programs[key] = (schedule, without_global_clip(program), eval_program)
        return self._programs[key]

    def _check_chunks_everywhere(self, chunks, local, placement, group, size: int, num_microbatches: int) -> None:
        """:func:`check_chunks` on every rank of the pipeline, its verdicts shared (once per chunk list and shape):
        a rank whose chunks do not fit raises, and so does every other one, before any forward (none waits for a
        message the misfit rank will never send)."""
        key = (tuple(id(c) for c in chunks), size, num_microbatches, id(group))
        if key in self._checked:
            return
        try:
            check_chunks(chunks, local, placement, self.name, self.options, self.rank)
            mine = None
        except ValueError as exc:
            mine = str(exc)
        # who failed, through a bounded wait (a dead peer is named, not waited on), then the texts if any did
        flags = torch.zeros(size, device=chunks_device(chunks))
        flags[self.rank] = 0.0 if mine is None else 1.0
        with self.guard("the check of every rank's model chunks"):
            wait_or_fail(lambda: dist.all_reduce(flags, group=group, async_op=True), self.timeout_s,
                         "the check of every rank's model chunks")
        if flags.sum().item() == 0:
            self._checked.add(key)
            return
        every = [None] * size
        dist.all_gather_object(every, mine, group=group)
        rank, error = next((rank, error) for rank, error in enumerate(every) if error)
        raise ValueError(error if rank == self.rank else f"pipeline rank {rank}'s model chunks: {error}")

    def _communication(self, schedule, group, device):
        ranks = (dist.get_process_group_ranks(group) if group is not dist.group.WORLD
                 else list(range(dist.get_world_size())))
        # the group object too: after Megatron's destroy_model_parallel() / initialize_model_parallel() the same
        # ranks form new groups, and ours, made beside the old ones, are made again
        key = (group, tuple(ranks), tuple(map(tuple, schedule.placement.stage_ranks)), str(device))
        if key not in self._comms:
            # new groups (Megatron's were rebuilt): after a failure every rank caught, a new job
            epoch = faults.start_new_job(self.timeout_s)
            nccl = dist.get_backend(group) != "gloo"
            with faults.guard("the creation of the pipeline's process groups", self.timeout_s, epoch):
                groups = _pipeline_groups(schedule.placement, ranks, nccl, self.timeout_s)
            p2p = P2P(lambda p: ranks[p], device, len(schedule.placement.chunks), self.timeout_s, groups.edges,
                      default_group=groups.job)
            p2p.shape_hint = "set variable_seq_lengths=True in the model's config (Megatron's switch for this)"
            self._comms[key] = (groups, p2p, epoch)
            self._fault_groups = groups.all_groups() + [group]
            faults.register(self)
        return self._comms[key]

    def fault_groups(self) -> list:
        """The process groups a failure must break to end this runner's waits (runtime/faults.py)."""
        return list(getattr(self, "_fault_groups", [])) + _megatron_groups()

    def guard(self, what: str):
        """Work on this runner's job whose failure must end every rank (runtime/faults.py)."""
        return faults.guard(what, self.timeout_s, self.epoch, rebuild=REBUILD_GROUPS)

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 decoder_seq_length=None, forward_only=False, collect_non_loss_data=False, first_val_step=None,
                 adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None, force_all_reduce=False):
        # seq_length, micro_batch_size, decoder_seq_length, adjust_tensor_shapes_fn: Megatron needs them to
        # size its receive buffers; ds_chimera's messages carry their shapes. first_val_step is for FP8.
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
            raise PipelineShapeError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if collect_non_loss_data and not forward_only:
            raise ValueError("collect_non_loss_data=True needs forward_only=True (Megatron collects it in evaluation)")
        group = call_pipeline_group(pg_collection)
        size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        schedule, program, eval_program = self._schedule(size, num_microbatches)
        placement = schedule.placement
        local = placement.chunks_on(self.rank)
        device = chunks_device(chunks)
        self.groups, self.p2p, self.epoch = self._communication(schedule, group, device)
        self._check_chunks_everywhere(chunks, local, placement, group, size, num_microbatches)
        sources = self._sources(data_iterator, len(chunks))
        feeds, shared = [], {}
        for source in sources:
            if source is None:
                feeds.append(None)
            else:
                feeds.append(shared.setdefault(id(source), MicroBatchFeed(source, num_microbatches)))
        config = model_config(chunks[0])
        # as Megatron: fixed shapes (one header per edge) unless the config says they vary
        self.p2p.dynamic_shapes = bool(getattr(config, "variable_seq_lengths", False))
        train = not forward_only
        step = MegatronHost(self, schedule, chunks, feeds, config, forward_step_func, num_microbatches,
                            collect_non_loss_data, train)
        if train:
            check_split_backward(schedule, config, self.rank)
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
        self.last_schedule = schedule
        with self.guard(f"forward_backward_func ({self.name}, {'train' if train else 'forward only'})"):
            return self._run(step, program if train else eval_program, train, scale, config, chunks, shared,
                             placement, group, device, pg_collection, force_all_reduce)

    def _run(self, step, program, train, scale, config, chunks, feeds, placement, group, device, pg_collection,
             force_all_reduce):
        """One call's work, after every check: the program, the loss exchange, Megatron's gradient finalisation."""
        no_sync = config.no_sync_func if train and config.no_sync_func is not None else contextlib.nullcontext
        with contextlib.ExitStack() as stack:
            for func in (no_sync if isinstance(no_sync, list) else [no_sync]):
                stack.enter_context(func())
            trace = train and self.trace_next
            executor = StepExecutor(step)
            try:
                executor.run(program.ops[self.rank], train=train, scale=scale, device=device, trace=trace)
            finally:
                step.close()
            if trace:
                self.trace_next, self.last_records = False, executor.records
        for feed in feeds.values():
            feed.finish()
        finish_losses = start_loss_exchange(step.reduced, placement, group, device, self.rank, self.timeout_s)
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
