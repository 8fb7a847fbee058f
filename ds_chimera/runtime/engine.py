"""The DeepSpeed engine that runs any lowered schedule: a thin adapter.

It is DeepSpeed's ``PipelineEngine`` (optimizer wrappers, LR schedulers, checkpoint
layout, logging, topology) with the step itself replaced: instead of the fixed 1F1B
instruction stream, :class:`~.executor.StepExecutor` runs the rank's lowered program,
the whole step (compute, messages, gradient syncs, clipping, the optimizer step), on a
:class:`~.host.PipelineHost`. This class only translates DeepSpeed's API (``train_batch``,
``eval_batch``, checkpoints) into those calls; checkpoints are in :mod:`.checkpoint`.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from deepspeed.runtime.pipe.engine import PipelineEngine

from ..logs import get_logger
from ..named_files import READ_ERRORS, describe
from . import checkpoint as ckpt
from . import faults
from .eval_outputs import RecordingHost, broadcast_losses, check_eval_arguments, collect, reduce_outputs
from .executor import StepExecutor
from .groups import process_groups_in
from .handoff import PreparedPipeline
from .host import PipelineHost
from .p2p import post_or_fail, wait_or_fail
from .tensors import to_device

log = get_logger()
LAYOUT_FILE = ckpt.LAYOUT_FILE


class ScheduledPipelineEngine(PipelineEngine):
    """A PipelineEngine whose step is the lowered program of a ds_chimera schedule."""

    host_class = PipelineHost

    def __init__(self, *args, prepared: PreparedPipeline, **kwargs):
        """DeepSpeed's constructor arguments, and what set-up built (``prepared``: runtime/handoff.py)."""
        plan = prepared.plan
        # DeepSpeed's constructor calls back into this class (set_dataiterator): both are read there
        self.prepared, self.plan = prepared, plan
        # after a failure every rank caught, a new engine is a new job (runtime/faults.py)
        self._fault_epoch = faults.start_new_job(plan.timeout_s)
        super().__init__(*args, **kwargs)
        self.schedule = plan.schedule
        self.placement = plan.schedule.placement
        self.pipe_rank = self.grid.get_stage_id()
        self.dp_size = self.grid.get_data_parallel_world_size()
        # DeepSpeed's own clipping only sees part of the model; the program's CLIP uses the true global norm.
        self._config.gradient_clipping = 0.0
        if self.using_bf16_optimizer:
            # bf16: gradients accumulate in the optimizer's fp32 buffers (immediate_grad_update),
            # and that is what is all-reduced and clipped; its own (partial-norm) clipping is off.
            self.optimizer.clip_grad = 0.0
        if plan.config.fp16_masters:     # the chunks become fp16, the optimizer steps fp32 masters (fp16_masters.py)
            from .fp16_masters import Fp16MasterOptimizer
            from .loss_scale import LossScale
            self.optimizer = Fp16MasterOptimizer(self.optimizer, LossScale(plan.config.loss_scale),
                                                 modules=[*prepared.chunks, prepared.tied])
        self.host = self.host_class(self)
        if self.host.shards is not None:
            self.host.shards.engine_ready()
        self.executor = StepExecutor(self.host)
        self.faults = faults.monitor(plan.timeout_s)     # one rank's failure ends every rank, naming it
        faults.register(self)
        self._deferred_plan = None      # "auto" planned at the first call (planner/deferred.py)
        self._pending_batches = []      # micro-batches taken from the iterator before the step (that plan's)
        self._given_iterator = None     # the script's iterator on every rank (the plan may move the data ranks)
        self.step_records = []
        self._eval_programs = {}        # micro-batch count -> Plan, for eval_batch(num_micro_batches=)
        self._train_plans = {plan.schedule.micro_batches: plan}   # set_train_batch_size's, each built once
        if self.global_rank == 0:
            log.info("schedule %r on %d ranks x %d data-parallel, %d micro-batches, %d chunk(s) per rank",
                     self.schedule.name, self.num_stages, self.dp_size, self.micro_batches,
                     len(self.host.chunk_modules))

    @property
    def auto_decision(self) -> dict | None:
        """Under ``"schedule": "auto"``: the planner's choice (``"pipeline"``), its predicted step (``"step_s"``)
        and peak memory (``"peak_bytes"``); None for a named schedule."""
        decided = self.plan.config.planned_by
        return dict(decided) if decided is not None else None

    def fault_groups(self) -> list:
        """The process groups a failure must break to end this engine's waits (runtime/faults.py)."""
        return self.host.groups.all_groups() + process_groups_in(self.grid, self.optimizer, self)

    @property
    def chunk_modules(self) -> dict:
        return self.host.chunk_modules

    @property
    def p2p(self):
        return self.host.transport

    def global_grad_norm(self) -> float:
        """The gradient norm over unique parameters, summed over the pipeline (collective)."""
        return self.host.global_grad_norm()

    # ---- data ----------------------------------------------------------------------------
    def _loads_data(self) -> bool:
        return self.plan.loads_data(self.grid.get_stage_id())

    def set_dataiterator(self, iterator):
        self._given_iterator = iterator
        if self._loads_data():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader):
        self._given_iterator = iter(loader)
        if self._loads_data():
            self.training_dataloader = loader
            self.data_iterator = self._given_iterator

    def _load_batches(self, count: int) -> dict:
        """Every data-loading rank reads all ``count`` micro-batches of the step, in order."""
        if not self._loads_data():
            return {}
        # under tensor parallelism a script may give data to tensor rank 0 only: its batch_fn then broadcasts each
        # batch over the tensor group (Megatron-DeepSpeed's get_batch_pipe), as the stock engine lets it
        fed_by_tensor_rank0 = self.batch_fn is not None and self.grid.get_slice_parallel_world_size() > 1
        if self.data_iterator is None and not fed_by_tensor_rank0:
            raise ValueError("ds_chimera: this rank runs a first or last stage and needs data: pass data_iter "
                             "to train_batch()/eval_batch() or training_data to initialize()")
        batches = {}
        for mb in range(count):
            batch = self._pending_batches.pop(0) if self._pending_batches else self._next_batch()
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError("pipeline batches must be (inputs, labels) pairs, as DeepSpeed's; "
                                 f"got {type(batch).__name__}")
            batches[mb] = (to_device(batch[0], self.device), to_device(batch[1], self.device))
        return batches

    # ---- steps ---------------------------------------------------------------------------
    def _aggregate_loss(self, loss_sum, micro_batches: int):
        """Global mean of the micro-batch losses, on every rank (losses may live on several ranks)."""
        return self._start_loss_mean(loss_sum, micro_batches)()

    def _start_loss_mean(self, loss_sum, micro_batches: int):
        """Post the loss all-reduce now; the returned function waits for it and gives the mean.

        ``train_batch`` posts it as soon as the rank's last loss of the step is computed, in
        the program's tail, so its latency (a rendezvous of every rank) overlaps the last
        backwards, the gradient syncs and the step instead of following them. It is the only
        collective on the default group during the program, so every rank posts the same
        collectives in the same order on each group.
        """
        total = torch.zeros(1, dtype=torch.float32, device=self.device)
        if loss_sum is not None and self.grid.get_slice_parallel_rank() == 0:   # every tensor rank has the loss
            total += loss_sum.reshape(-1)[:1].to(total.dtype)
        group = self.host.groups.job
        work = post_or_fail(lambda: dist.all_reduce(total, group=group, async_op=True), "the loss all-reduce")

        def mean():
            wait_or_fail(work, self.plan.timeout_s, "the loss all-reduce")
            return (total / (micro_batches * self.dp_size)).squeeze(0)
        return mean

    def _guard(self, what: str):
        """Work whose failure must end every rank (see :mod:`.faults`)."""
        return faults.guard(f"{what} (step {self.global_steps})", epoch=self._fault_epoch)

    def train_batch(self, data_iter=None):
        if not torch._C.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self._deferred_plan is not None:    # its failures end every rank as initialize's do (planner/deferred.py)
            self._deferred_plan.plan_and_rebuild(self, data_iter)
            data_iter = None
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        start = time.perf_counter()
        self.tput_timer.start()
        trace = self.plan.trace_dir is not None
        with self._guard("train_batch"):
            self.agg_train_loss = self._train_call(trace)
        self.tput_timer.stop(global_step=True)
        if trace:
            self._write_trace()
        self._print_progress(time.perf_counter() - start)
        if self._monitoring():
            self._write_monitor_events(("Train/Samples/lr", self.get_lr()[0]),
                                       ("Train/Samples/train_loss", self.agg_train_loss.mean().item()))
        return self.agg_train_loss

    def _monitoring(self) -> bool:
        """Whether this rank writes monitor events (rank 0, a monitor enabled): the values are read only then,
        so other ranks never wait on a device for them."""
        return self.global_rank == 0 and self.monitor.enabled

    def _write_monitor_events(self, *events) -> None:
        """The events the stock engine writes to its monitors (TensorBoard, W&B, Comet, CSV), at the samples
        seen so far: the same names, steps and values under every schedule."""
        self.summary_events = [(name, value, self.global_samples) for name, value in events]
        self.monitor.write_events(self.summary_events)

    def _train_call(self, trace: bool):
        """One train_batch: the program is the whole step (syncs, clipping and the step included)."""
        self.host.begin(self._load_batches(self.micro_batches), train=True)
        posted = []                          # the loss all-reduce, posted once this rank's losses are known

        def post_loss(loss_sum):
            posted.append(self._start_loss_mean(loss_sum, self.micro_batches))
        self.executor.run(self.plan.program.ops[self.pipe_rank], train=True,
                          scale=self._loss_scale() / self.micro_batches, trace=trace, on_losses=post_loss,
                          device=self.device)
        loss_mean, = posted
        return loss_mean()

    def _loss_scale(self) -> float:
        """fp16: the loss scale each backward starts from (ZeRO-0: runtime/loss_scale.py; ZeRO-1: DeepSpeed's
        ZeRO-1 optimizer's own DynamicLossScaler); 1 otherwise."""
        return self.optimizer.cur_scale if self.plan.config.fp16 else 1.0

    def _print_progress(self, elapsed: float) -> None:
        """DeepSpeed-style progress line every ``steps_per_print`` train_batch calls."""
        self.train_batch_calls = getattr(self, "train_batch_calls", 0) + 1
        every = self.steps_per_print()
        if self.global_rank == 0 and every and self.train_batch_calls % every == 0:
            samples = self.train_batch_size() / elapsed
            log.info("%s steps: %d loss: %0.4f iter time (s): %0.3f samples/sec: %0.3f", self.schedule.name,
                     self.global_steps, self.agg_train_loss.item(), elapsed, samples)

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """The stock engine's ``eval_batch``, every argument included (see :mod:`.eval_outputs`).

        The default arguments return the mean loss on every rank (``bcast_loss=False`` too: the value is
        there anyway); the others follow the stock engine, results on its last stage's rank."""
        check_eval_arguments(reduce_output, num_micro_batches)
        if self._deferred_plan is not None:
            self._deferred_plan.plan_and_rebuild(self, data_iter)
            data_iter = self.data_iterator
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        program = self._eval_program(micro_batches)
        plain = compute_loss and not return_logits and reduce_output is not None
        self.module.eval()
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        try:
            with torch.no_grad(), self._guard("eval_batch"):
                batches = self._load_batches(micro_batches)
                if plain:
                    result, logits = self._eval_mean_loss(program, batches, micro_batches), None
                else:
                    result, logits = self._eval_recorded(program, batches, micro_batches, return_logits,
                                                         compute_loss, reduce_output, bcast_loss)
            if self._monitoring() and compute_loss and result is not None:
                loss = result if isinstance(result, torch.Tensor) else torch.stack(list(result)).mean()
                self._write_monitor_events(("Train/Samples/eval_loss", loss.mean().item()))
            return (result, logits) if return_logits else result
        finally:
            self.data_iterator = saved
            self.module.train()

    def _eval_program(self, micro_batches: int):
        """This rank's forward-only ops for ``micro_batches`` (another count than training's is built once)."""
        if micro_batches == self.micro_batches:
            return self.plan.eval_program.ops[self.pipe_rank]
        if micro_batches not in self._eval_programs:
            from .plan import with_micro_batches
            self._eval_programs[micro_batches] = with_micro_batches(self.plan, micro_batches,
                                                                    f"eval_batch(num_micro_batches={micro_batches})")
        return self._eval_programs[micro_batches].eval_program.ops[self.pipe_rank]

    def _eval_mean_loss(self, ops, batches: dict, micro_batches: int):
        self.host.begin(batches, train=False)
        loss_sum, _ = self.executor.run(ops, train=False, scale=1.0)
        return self._aggregate_loss(loss_sum, micro_batches)

    def _eval_recorded(self, ops, batches: dict, micro_batches: int, return_logits: bool, compute_loss: bool,
                       reduce_output, bcast_loss: bool):
        recorded = RecordingHost(self.host, compute_loss, micro_batches - 1 if return_logits else None)
        self.host.begin(batches, train=False)
        StepExecutor(recorded).run(ops, train=False, scale=1.0)
        values, logits = collect(self, recorded, micro_batches, return_logits)
        result = reduce_outputs(self, values, reduce_output, micro_batches) if values is not None else None
        if compute_loss and (bcast_loss or self.monitor.enabled):
            result = broadcast_losses(self, result, reduce_output, micro_batches)
        return result, logits

    def set_train_batch_size(self, train_batch_size):
        """The stock engine's batch-size change (more or fewer micro-batches of the same size): the schedule's
        programs are built and proven for the new count before anything changes."""
        from .plan import with_micro_batches
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_size
        if not isinstance(train_batch_size, int) or train_batch_size < per_step or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size: train_batch_size must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu x data-parallel size = {per_step}, got "
                             f"{train_batch_size!r}")
        micro_batches = train_batch_size // per_step
        if micro_batches == self.schedule.micro_batches:
            super().set_train_batch_size(train_batch_size)   # a ramp-up script calls this every step: nothing to do
            return
        plan = self._train_plans.get(micro_batches)
        if plan is None:
            plan = with_micro_batches(self.plan, micro_batches, f"set_train_batch_size({train_batch_size})")
            self._train_plans[micro_batches] = plan
            if self.global_rank == 0:
                log.info("schedule %r built for %d micro-batches (train_batch_size %d)", plan.schedule.name,
                         micro_batches, train_batch_size)
        super().set_train_batch_size(train_batch_size)
        self.plan = self.host.plan = plan
        self.schedule = plan.schedule

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self.p2p.sent_meta.clear()
        self.p2p.recv_meta.clear()

    def _write_trace(self) -> None:
        from ..atomic import write_json_atomic
        from ..sim.trace import trace_events
        events = trace_events(self.executor.records, self.placement, time_unit_us=1e6,
                              label=f"{self.schedule.name} measured")
        path = os.path.join(self.plan.trace_dir, f"step{self.global_steps:06d}-rank{self.global_rank:03d}.json")
        write_json_atomic(path, {"traceEvents": events, "displayTimeUnit": "ms"})

    # ---- checkpoints (DeepSpeed's layout, written atomically: see .checkpoint) ----------------
    def _layer_objects(self) -> dict:
        return ckpt.layer_objects(self)

    def owned_layers(self) -> dict:
        """Global layer index -> layer, for the layers this rank writes out (checkpoints, HF export)."""
        return ckpt.owned_layers(self)

    def module_state_dict(self, exclude_frozen_parameters=False):
        """Write one file per global layer index, once per stage even where it is replicated."""
        ckpt.save_layers(self, self._curr_ckpt_path, exclude_frozen_parameters)
        return None

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                               z3_params_to_fetch=None, allowed_missing_keys=None):
        ckpt.load_layers(self, self._curr_ckpt_path, strict)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None, **kwargs):
        """DeepSpeed's load, refusing optimizer state saved under another layout (it would be misread)."""
        if tag is None:
            tag = ckpt.read_latest(load_dir)
            if tag is None:      # as DeepSpeed: nothing to resume from is a warning and (None, None)
                log.warning("no checkpoint to load in %s: it has no 'latest' file (a save that did not "
                            "complete writes none); pass tag=... to load a given one", load_dir)
                return None, None
        saved = ckpt.saved_layout(load_dir, tag)          # None: written by DeepSpeed's stock engine
        if self._deferred_plan is not None and saved is not None:
            # "auto" not planned yet: the run goes on under the plan the checkpoint was written under
            self._deferred_plan.adopt(self, saved, f"{load_dir}/{tag}")
            rebuilt = ckpt.layout(self)
            if ckpt.OPTIONS not in saved and ckpt.placement_of(rebuilt) != ckpt.placement_of(saved):
                raise ValueError(f"checkpoint {load_dir}/{tag} was written under {saved} by a ds_chimera that did "
                                 f"not record the schedule's options, and {saved['schedule']!r} with its defaults "
                                 f"is {rebuilt}: name that schedule and its options in the \"pipeline\" section "
                                 f"(or the plan_file its run wrote) to resume it")
        stock_state = None
        if load_optimizer_states and not load_module_only:
            if saved is None:      # the stock engine's: mapped parameter by parameter
                stock_state = ckpt.stock_optimizer_state(self, load_dir, tag)
            else:
                ckpt.check_layout(self, saved, load_dir, tag)
        with self._guard(f"load_checkpoint {load_dir}/{tag}"), self.gathered_weights():
            try:
                result = super().load_checkpoint(load_dir, tag=tag, load_module_strict=load_module_strict,
                                                 load_optimizer_states=load_optimizer_states and stock_state is None,
                                                 load_lr_scheduler_states=load_lr_scheduler_states,
                                                 load_module_only=load_module_only, custom_load_fn=custom_load_fn,
                                                 **kwargs)
            except ValueError:
                raise           # ours: it names the file
            except READ_ERRORS as exc:
                damaged = ckpt.damaged_state_files(os.path.join(load_dir, str(tag)))
                which = f"damaged: {', '.join(damaged)}" if damaged else \
                    f"it reads {self._get_ckpt_name(load_dir, tag)} and the other ranks' model states"
                raise ValueError(f"checkpoint {load_dir}/{tag}: DeepSpeed could not read it on rank "
                                 f"{self.global_rank} ({which}): {describe(exc)}; the file is damaged or "
                                 f"truncated: {ckpt.DAMAGED_FIX}") from exc
            if stock_state is not None and result[0] is not None:
                self.optimizer.load_state_dict(stock_state)
            if self.host.shards is not None and result[0] is not None:    # the loaded full weights' slices
                for sharded in self.host.shards.by_chunk.values():
                    sharded.shard_from_full()
            if result[0] is not None and (load_module_only or not load_optimizer_states) and \
                    hasattr(self.optimizer, "refresh_fp32_params"):
                # weights without optimizer state: the fp32 masters (ours under fp16, DeepSpeed's bf16 and ZeRO-1
                # optimizers') follow them; DeepSpeed refreshes them for load_module_only only, so a weights-only
                # load would otherwise step from the masters' old values and write them back
                self.optimizer.refresh_fp32_params()
            if self.using_bf16_optimizer:
                self.optimizer.clip_grad = 0.0     # a loaded state restores DeepSpeed's partial-norm clipping
            if load_optimizer_states and not load_module_only and result[0] is not None and tag is not None:
                self._load_extra_state(os.path.join(load_dir, str(tag)))
            self._barrier(f"every rank's load of checkpoint {load_dir}/{tag}")
        if self._deferred_plan is not None:     # a stock checkpoint: loaded again into the planned engine
            self._deferred_plan.loads.append(((load_dir,), dict(
                tag=tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                custom_load_fn=custom_load_fn, **kwargs)))
        return result

    def _save_extra_state(self, directory: str) -> None:
        """State of this rank beyond DeepSpeed's: ZeRO-2/3 shards (subclasses: predictor state)."""
        if self.host.shards is not None:
            ckpt.save_shards(self, directory)

    def _load_extra_state(self, directory: str) -> None:
        """Counterpart of :meth:`_save_extra_state`; ``directory`` is the loaded tag's."""
        if self.host.shards is not None:
            ckpt.load_shards(self, directory)

    def gathered_weights(self):
        """A context in which every chunk's full weights are present (ZeRO-3 releases them between uses):
        read them (``owned_layers()``, an export) inside it. Collective over data parallelism."""
        import contextlib
        shards = self.host.shards

        @contextlib.contextmanager
        def gathered():
            released = shards.gather_all() if shards is not None else []
            try:
                yield self
            finally:
                for chunk in released:
                    shards.release(chunk)
        return gathered()

    def _barrier(self, what: str) -> None:
        """A barrier of every rank, bounded by the pipeline timeout."""
        group = self.host.groups.job
        wait_or_fail(lambda: dist.barrier(group=group, async_op=True), self.plan.timeout_s, what, peer="a rank")

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint, written into a temporary tag and renamed when every rank is done.

        A crash mid-save leaves the previous checkpoint and ``latest`` untouched; the next
        complete save removes what the interrupted one left behind.
        """
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        with self._guard(f"save_checkpoint {save_dir}/{tag}"), self.gathered_weights():
            self._save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        return True

    def _save(self, save_dir, tag: str, client_state, save_latest: bool, exclude_frozen_parameters: bool) -> None:
        tmp_tag = os.path.basename(ckpt.stage_dir(save_dir, tag))
        state = dict(client_state or {})
        state["ds_chimera_schedule"] = self.schedule.name
        staged = ckpt.stage_dir(save_dir, tag)
        if self.global_rank == 0:
            ckpt.start_staging(save_dir, tag)
        self._barrier(f"the start of checkpoint {tag!r}")
        super().save_checkpoint(save_dir, tag=tmp_tag, client_state=state, save_latest=False,
                                exclude_frozen_parameters=exclude_frozen_parameters)
        self._save_extra_state(staged)
        self._barrier(f"every rank's part of checkpoint {tag!r}")
        if self.global_rank == 0:
            ckpt.publish(self, save_dir, tag, save_latest)
        self._barrier(f"the rename of checkpoint {tag!r}")
