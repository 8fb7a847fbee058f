"""The DeepSpeed engine that runs any lowered schedule.

It is DeepSpeed's ``PipelineEngine`` (optimizer wrappers, LR schedulers, checkpoint
layout, logging, topology) with the step itself replaced: instead of the fixed 1F1B
instruction stream, :class:`StepExecutor` runs the rank's lowered program. Gradient
synchronisation, tied weights and clipping are done here because the schedule decides
when they can start.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time

import torch
import torch.distributed as dist

from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import TiedLayerSpec

from .executor import StepExecutor, _to_device
from .gradsync import FlatGradAllReduce
from .p2p import P2P, post_or_fail

log = logging.getLogger("ds_chimera")
LAYOUT_FILE = "ds_chimera_layout.json"


class ScheduledPipelineEngine(PipelineEngine):
    """A PipelineEngine whose step is the lowered program of a ds_chimera schedule."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        plan = self.module._ds_chimera_plan
        self.plan = plan
        self.schedule = plan.schedule
        self.placement = plan.schedule.placement
        self.pipe_rank = self.grid.get_stage_id()
        if self.grid.get_slice_parallel_world_size() != 1:
            raise ValueError("ds_chimera schedules do not support tensor (slice) parallelism yet; "
                             f"got slice-parallel size {self.grid.get_slice_parallel_world_size()}")
        self.dp_size = self.grid.get_data_parallel_world_size()
        # ZeRO-1 owns the data-parallel reduction (into optimizer-state partitions) and the
        # clipping; our syncs then only cover replicas and tied weights inside one pipeline.
        self.zero1 = self.zero_optimization_stage() == 1
        self.chunk_modules = {chunk.index: chunk for chunk in self.module.ds_chimera_chunks}
        self.tied_modules = self.module.ds_chimera_tied
        self.stage_chunk = {chunk.stage: c for c, chunk in self.chunk_modules.items()}
        self.split_chunks = {a.chunk for a in self.schedule.orders[self.pipe_rank] if a.kind == "I"}
        self._build_groups()
        self.p2p = P2P(self._global_rank_of, self.device, len(self.placement.chunks), plan.timeout_s,
                       self._nccl_p2p_groups(), dynamic_shapes=bool(getattr(self.module, "dynamic_shape", False)))
        self.executor = StepExecutor(self)
        # DeepSpeed's fp32 clipping only sees part of the model; ours clips on the true global norm.
        self.true_clip = plan.clip
        self._config.gradient_clipping = 0.0
        self._hp_grads = {}
        if self.using_bf16_optimizer:
            # bf16: gradients accumulate in the optimizer's fp32 buffers (immediate_grad_update),
            # and that is what we all-reduce and clip; its own (partial-norm) clipping is off.
            self.optimizer.clip_grad = 0.0
            for i, group in enumerate(self.optimizer.bf16_groups):
                for j, lp in enumerate(group):
                    self._hp_grads[id(lp)] = self.optimizer.fp32_groups_gradients[i][j]
        self.pending_syncs = []
        self.step_records = []
        if self.global_rank == 0:
            log.info("ds_chimera: schedule %r on %d ranks x %d data-parallel, %d micro-batches, %d chunk(s) per rank",
                     self.schedule.name, self.num_stages, self.dp_size, self.micro_batches,
                     len(self.chunk_modules))

    # ---- topology and groups -------------------------------------------------------------
    def _global_rank_of(self, pipe_rank: int, dp_id=None) -> int:
        # stage_to_global keeps this rank's other coordinates (e.g. a model axis of size 1)
        return self.grid.stage_to_global(pipe_rank) if dp_id is None else \
            self.grid.stage_to_global(pipe_rank, data=dp_id)

    def _tied_keys_of(self, chunk) -> list:
        specs = self.module._layer_specs
        start, stop = self.plan.parts[chunk.stage], self.plan.parts[chunk.stage + 1]
        return sorted({specs[i].key for i in range(start, stop) if isinstance(specs[i], TiedLayerSpec)})

    def _ranks_over_dp(self, pipe_ranks, dp_id=None) -> list:
        dps = [dp_id] if dp_id is not None else range(self.dp_size)
        return sorted(self._global_rank_of(p, d) for p in pipe_ranks for d in dps)

    def _build_groups(self):
        """One all-reduce group per stage (its replicas x data parallel) and per tied key.

        ``dist.new_group`` is collective: every rank creates every group, in one order.
        """
        placement, specs = self.placement, self.module._layer_specs
        cache, self.stage_groups, self.tied_groups = {}, {}, {}

        def group_for(ranks):
            ranks = tuple(ranks)
            if ranks not in cache:
                cache[ranks] = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            return cache[ranks]

        my_dp = self.grid.get_data_parallel_id()
        dp_slices = list(range(self.dp_size)) if self.zero1 else [None]
        for stage in range(placement.num_stages):
            for d in dp_slices:
                group = group_for(self._ranks_over_dp(placement.stage_group(stage), d))
                if stage in self.stage_chunk and d in (None, my_dp):
                    self.stage_groups[stage] = group
        holders = {}
        for chunk in placement.chunks:
            for i in range(self.plan.parts[chunk.stage], self.plan.parts[chunk.stage + 1]):
                if isinstance(specs[i], TiedLayerSpec):
                    holders.setdefault(specs[i].key, set()).add(chunk.rank)
        self.tied_owner = {}
        for key in sorted(holders):
            self.tied_owner[key] = min(holders[key])
            for d in dp_slices:
                group = group_for(self._ranks_over_dp(holders[key], d))
                if key in self.tied_modules and d in (None, my_dp):
                    self.tied_groups[key] = group

    def _nccl_p2p_groups(self) -> dict:
        """NCCL matches point-to-point messages in issue order, not by tag: one group per edge."""
        if dist.get_backend() == "gloo":
            return {}
        groups, placement = {}, self.placement
        for d in range(self.dp_size):
            for chunk in placement.chunks:
                nxt = placement.next_chunk(chunk.index)
                if nxt is None or placement.rank_of(nxt) == chunk.rank:
                    continue
                ranks = sorted({self._global_rank_of(chunk.rank, d), self._global_rank_of(placement.rank_of(nxt), d)})
                for kind, edge in (("act", (chunk.index, nxt)), ("grad", (nxt, chunk.index))):
                    group = dist.new_group(ranks)
                    if self.grid.get_data_parallel_id() == d:
                        groups[(edge[0], edge[1], kind)] = group
        return groups

    # ---- data ----------------------------------------------------------------------------
    def _loads_data(self) -> bool:
        return self.module._ds_chimera_plan.loads_data(self.grid.get_stage_id())

    def set_dataiterator(self, iterator):
        if self._loads_data():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader):
        if self._loads_data():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def _load_batches(self, count: int) -> dict:
        """Every data-loading rank reads all ``count`` micro-batches of the step, in order."""
        if not self._loads_data():
            return {}
        if self.data_iterator is None:
            raise ValueError("ds_chimera: this rank runs a first or last stage and needs data: pass data_iter "
                             "to train_batch()/eval_batch() or training_data to initialize()")
        batches = {}
        for mb in range(count):
            batch = self._next_batch()
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError("pipeline batches must be (inputs, labels) pairs, as DeepSpeed's; "
                                 f"got {type(batch).__name__}")
            batches[mb] = (_to_device(batch[0], self.device), _to_device(batch[1], self.device))
        return batches

    def compute_loss(self, outputs, labels):
        loss_fn = self.module.loss_fn
        return loss_fn(outputs, labels) if loss_fn is not None else outputs

    # ---- gradients -----------------------------------------------------------------------
    def start_grad_sync(self, stage: int) -> None:
        """Post the all-reduce of one stage's gradients; called by the program right after its last backward."""
        chunk = self.chunk_modules[self.stage_chunk[stage]]
        group = self.stage_groups.get(stage)
        self._post_allreduce(chunk, group, f"stage {stage}")
        if self.zero1 and group is None and self.plan.zero1_reduce == "chunk":
            self._zero1_reduce(chunk.parameters())
            self.zero1_early_chunks += 1

    # ---- ZeRO-1: each chunk's gradients go to their optimizer partitions when the chunk is done ----
    def _zero1_start(self) -> None:
        """Prepare DeepSpeed's reduce buckets, as its own pipeline path does in reduce_gradients."""
        from deepspeed.accelerator import get_accelerator
        opt = self.optimizer
        opt.set_gradient_accumulation_boundary(False)     # reduce hooks (overlap_comm) stay idle in backward
        if opt.contiguous_gradients:
            for dtype, bucket in opt.ipg_buckets.items():
                bucket.buffer.append(torch.empty(int(opt.reduce_bucket_size), dtype=dtype,
                                                 device=get_accelerator().current_device_name()))
                bucket.index = 0
        self._zero1_reduced = set()
        self.zero1_early_chunks = 0          # chunks reduced before the flush in this call (for inspection)
        if not hasattr(self, "_zero1_group_of"):
            self._zero1_group_of = {id(p): i for i, group in enumerate(opt.bit16_groups) for p in group}

    def _zero1_reduce(self, params, flush: bool = True) -> None:
        """Hand finished gradients to ZeRO's reduction (into the owning data-parallel rank's partition).

        With ``overlap_comm`` DeepSpeed runs the reduction on a side stream, so it overlaps the
        chunks still computing; without it the reduction runs now, in this rank's bubble.
        """
        opt = self.optimizer
        opt.set_gradient_accumulation_boundary(True)
        try:
            for p in params:
                if id(p) in self._zero1_reduced or id(p) not in self._zero1_group_of or \
                        opt.get_gradient_for_reduction(p) is None:
                    continue
                opt.reduce_ready_partitions_and_remove_grads(p, self._zero1_group_of[id(p)])
                self._zero1_reduced.add(id(p))
            if flush:
                opt.reduce_ipg_grads()
                if opt.contiguous_gradients and opt.overlap_comm:
                    for bucket in opt.ipg_buckets.values():
                        bucket.index = 1 - bucket.index
        finally:
            opt.set_gradient_accumulation_boundary(False)

    def _zero1_finish(self) -> None:
        """Reduce what no chunk reduced (tied modules, or zero1_reduce="end"), then ZeRO's epilogue."""
        opt = self.optimizer
        self._zero1_reduce([p for group in opt.bit16_groups for p in group], flush=False)
        opt.set_gradient_accumulation_boundary(True)
        opt.overlapping_partition_gradients_reduce_epilogue()

    def _post_allreduce(self, module, group, what: str) -> None:
        """Start an async all-reduce of ``module``'s gradients, flattened; _finish_grad_syncs waits."""
        params = [p for p in module.parameters() if p.requires_grad]
        if group is None or not params:
            return
        if not self._hp_grads:
            for p in params:          # the sum is written back in place: a missing gradient is a zero one
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        self.pending_syncs.append(FlatGradAllReduce(self._grads(params), group, what))

    def _grads(self, params) -> list:
        """The gradient each parameter's optimizer reads: fp32 master grads under bf16."""
        if self._hp_grads:
            return [self._hp_grads[id(p)] for p in params]
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def _finish_grad_syncs(self) -> None:
        for key in sorted(self.tied_groups):
            self._post_allreduce(self.tied_modules[key], self.tied_groups[key], f"tied weights {key!r}")
        divide_by = self.dp_size if not self.zero1 else 1     # ZeRO-1 averages over data parallel itself
        for sync in self.pending_syncs:
            sync.finish(self.plan.timeout_s, divide_by)
        self.pending_syncs = []

    def _owned_params(self) -> list:
        """Parameters this rank counts in the global norm: each stage and tied module once."""
        owned = []
        for c, chunk in self.chunk_modules.items():
            if min(self.placement.stage_group(chunk.stage)) == self.pipe_rank:
                owned += [p for p in chunk.parameters() if p.requires_grad]
        for key, module in self.tied_modules.items():
            if self.tied_owner[key] == self.pipe_rank:
                owned += [p for p in module.parameters() if p.requires_grad]
        return owned

    def global_grad_norm(self) -> float:
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        owned = self._owned_params()
        for g in (self._grads(owned) if self._hp_grads else [p.grad for p in owned]):
            if g is not None:
                squares += g.detach().double().pow(2).sum()
        self.p2p._wait(lambda: dist.all_reduce(squares, group=self.grid.get_pipe_parallel_group(), async_op=True),
                       "the gradient-norm all-reduce")
        return float(squares.sqrt())

    def _clip_gradients(self) -> None:
        if self.true_clip <= 0:
            return
        norm = self.global_grad_norm()
        self._global_grad_norm = norm
        coef = self.true_clip / (norm + 1e-6)
        if coef < 1.0:
            if self._hp_grads:
                for g in self._hp_grads.values():
                    g.mul_(coef)
                return
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)

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
        if loss_sum is not None:
            total += loss_sum.reshape(-1)[:1].to(total.dtype)
        work = post_or_fail(lambda: dist.all_reduce(total, async_op=True), "the loss all-reduce")

        def mean():
            self.p2p._wait(work, "the loss all-reduce")
            return (total / (micro_batches * self.dp_size)).squeeze(0)
        return mean

    def train_batch(self, data_iter=None):
        if not torch._C.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        start = time.perf_counter()
        self.tput_timer.start()
        trace = self.plan.trace_dir is not None
        self.agg_train_loss = self._train_call(trace)
        self.tput_timer.stop(global_step=True)
        if trace:
            self._write_trace()
        self._print_progress(time.perf_counter() - start)
        return self.agg_train_loss

    def _train_call(self, trace: bool):
        """The work of one train_batch: the program, the gradient syncs, the step. Returns the mean loss."""
        batches = self._load_batches(self.micro_batches)
        if self.zero1:
            self._zero1_start()
        posted = []                          # the loss all-reduce, posted once this rank's losses are known

        def post_loss(loss_sum):
            posted.append(self._start_loss_mean(loss_sum, self.micro_batches))
        self.executor.run(self.plan.program.ops[self.pipe_rank], batches, train=True,
                          scale=1.0 / self.micro_batches, trace=trace, on_losses=post_loss)
        loss_mean, = posted
        self._finish_grad_syncs()
        if self.zero1:
            self._zero1_finish()             # ZeRO-1 averages into each rank's partition and clips there
        else:
            self._clip_gradients()
        self._take_model_step(None)
        return loss_mean()

    def _print_progress(self, elapsed: float) -> None:
        """DeepSpeed-style progress line every ``steps_per_print`` train_batch calls."""
        self.train_batch_calls = getattr(self, "train_batch_calls", 0) + 1
        every = self.steps_per_print()
        if self.global_rank == 0 and every and self.train_batch_calls % every == 0:
            samples = self.train_batch_size() / elapsed
            print(f"[ds_chimera {self.schedule.name}] steps: {self.global_steps} loss: {self.agg_train_loss.item():0.4f} "
                  f"iter time (s): {elapsed:0.3f} samples/sec: {samples:0.3f}", flush=True)

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        if return_logits or not compute_loss or reduce_output != "avg":
            raise ValueError("ds_chimera eval_batch supports return_logits=False, compute_loss=True, "
                             f"reduce_output='avg'; got return_logits={return_logits}, "
                             f"compute_loss={compute_loss}, reduce_output={reduce_output!r}")
        if num_micro_batches not in (None, self.micro_batches):
            raise ValueError(f"ds_chimera eval_batch runs the schedule's {self.micro_batches} micro-batches; "
                             f"got num_micro_batches={num_micro_batches}")
        self.module.eval()
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        try:
            with torch.no_grad():
                batches = self._load_batches(self.micro_batches)
                loss_sum, _ = self.executor.run(self.plan.eval_program.ops[self.pipe_rank], batches,
                                                train=False, scale=1.0)
            return self._aggregate_loss(loss_sum, self.micro_batches)
        finally:
            self.data_iterator = saved
            self.module.train()

    def set_train_batch_size(self, train_batch_size):
        raise ValueError("ds_chimera schedules are built for a fixed number of micro-batches "
                         f"({self.micro_batches}); changing the batch size needs a new engine")

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self.p2p.sent_meta.clear()
        self.p2p.recv_meta.clear()

    def _write_trace(self) -> None:
        from ..sim.trace import trace_events, write_json_atomic
        os.makedirs(self.plan.trace_dir, exist_ok=True)
        events = trace_events(self.executor.records, self.placement, time_unit_us=1e6,
                              label=f"{self.schedule.name} measured")
        path = os.path.join(self.plan.trace_dir, f"step{self.global_steps:06d}-rank{self.global_rank:03d}.json")
        write_json_atomic(path, {"traceEvents": events, "displayTimeUnit": "ms"})

    # ---- checkpoints ---------------------------------------------------------------------
    def _layer_objects(self) -> dict:
        from .chunks import layer_objects
        out = {}
        for chunk in self.chunk_modules.values():
            out.update({idx: (chunk.stage, obj) for idx, obj in layer_objects(chunk).items()})
        return out

    def _layer_file(self, path: str, idx: int) -> str:
        """DeepSpeed's name for a layer file: layer_XX[-<rank repr>]-model_states.pt."""
        repr_ = self.grid._topo.get_rank_repr(rank=self.global_rank)
        return os.path.join(path, f"layer_{idx:02d}{'-' + repr_ if repr_ else ''}-model_states.pt")

    def owned_layers(self) -> dict:
        """Global layer index -> layer, for the layers this rank writes out (checkpoints, HF export).

        Each stage once even where it is replicated (by its lowest rank), on data-parallel rank 0.
        """
        if self.grid.get_data_parallel_id() != 0:
            return {}
        return {idx: obj for idx, (stage, obj) in sorted(self._layer_objects().items())
                if min(self.placement.stage_group(stage)) == self.pipe_rank and hasattr(obj, "state_dict")}

    def module_state_dict(self, exclude_frozen_parameters=False):
        """Write one file per global layer index, once per stage even where it is replicated."""
        path = self._curr_ckpt_path
        if self.grid.get_data_parallel_id() != 0:
            return None
        os.makedirs(path, exist_ok=True)
        for idx, obj in self.owned_layers().items():
            state = {k: v.detach().clone() for k, v in obj.state_dict().items()}
            if exclude_frozen_parameters:
                frozen = {n for n, p in obj.named_parameters() if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            final = self._layer_file(path, idx)
            tmp = f"{final}.tmp{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, final)
        return None

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                               z3_params_to_fetch=None, allowed_missing_keys=None):
        path = self._curr_ckpt_path
        for idx, (_, obj) in sorted(self._layer_objects().items()):
            if not hasattr(obj, "load_state_dict"):
                continue
            file = self._layer_file(path, idx)
            if not os.path.exists(file):
                raise FileNotFoundError(f"checkpoint {path} has no weights for layer {idx} ({file})")
            obj.load_state_dict(torch.load(file, map_location=self.device, weights_only=False), strict=strict)

    def _layout(self) -> dict:
        """What decides which parameters (and so which optimizer state) each rank holds."""
        return {"schedule": self.schedule.name, "stages": self.num_stages, "data_parallel": self.dp_size,
                "parts": [int(p) for p in self.plan.parts],
                "stage_ranks": [[int(r) for r in ranks] for ranks in self.placement.stage_ranks]}

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None, **kwargs):
        """DeepSpeed's load, refusing optimizer state saved under another layout (it would be misread)."""
        if tag is None and os.path.exists(os.path.join(load_dir, "latest")):
            with open(os.path.join(load_dir, "latest")) as fh:
                tag = fh.read().strip()
        layout_path = os.path.join(load_dir, str(tag), LAYOUT_FILE) if tag is not None else ""
        if load_optimizer_states and not load_module_only:
            saved = None
            if os.path.exists(layout_path):
                with open(layout_path) as fh:
                    saved = json.load(fh)
            if saved != self._layout():
                raise ValueError(f"checkpoint {load_dir}/{tag} was written under {saved or 'another engine'}, "
                                 f"this engine is {self._layout()}: its optimizer state does not map onto these "
                                 f"chunks. Load the weights only: load_checkpoint(..., load_optimizer_states=False, "
                                 f"load_lr_scheduler_states=False)")
        result = super().load_checkpoint(load_dir, tag=tag, load_module_strict=load_module_strict,
                                         load_optimizer_states=load_optimizer_states,
                                         load_lr_scheduler_states=load_lr_scheduler_states,
                                         load_module_only=load_module_only, custom_load_fn=custom_load_fn, **kwargs)
        if self.using_bf16_optimizer:
            self.optimizer.clip_grad = 0.0     # a loaded state restores DeepSpeed's partial-norm clipping
        if load_optimizer_states and not load_module_only and result[0] is not None and tag is not None:
            self._load_extra_state(os.path.join(load_dir, str(tag)))
        return result

    def _save_extra_state(self, directory: str) -> None:
        """State of this rank beyond DeepSpeed's (subclasses: predictor state)."""

    def _load_extra_state(self, directory: str) -> None:
        """Counterpart of :meth:`_save_extra_state`; ``directory`` is the loaded tag's."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint, written into a temporary tag and renamed when every rank is done.

        A crash mid-save leaves the previous checkpoint and ``latest`` untouched.
        """
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        tmp_tag = f"{tag}.incomplete"
        state = dict(client_state or {})
        state["ds_chimera_schedule"] = self.schedule.name
        if self.global_rank == 0 and os.path.isdir(os.path.join(save_dir, tmp_tag)):
            shutil.rmtree(os.path.join(save_dir, tmp_tag))
        dist.barrier()
        super().save_checkpoint(save_dir, tag=tmp_tag, client_state=state, save_latest=False,
                                exclude_frozen_parameters=exclude_frozen_parameters)
        self._save_extra_state(os.path.join(save_dir, tmp_tag))
        dist.barrier()
        if self.global_rank == 0:
            final, staged = os.path.join(save_dir, tag), os.path.join(save_dir, tmp_tag)
            with open(os.path.join(staged, LAYOUT_FILE), "w") as fh:
                json.dump(self._layout(), fh)
            if os.path.isdir(final):
                old = f"{final}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(staged, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staged, final)
            if save_latest:
                latest = os.path.join(save_dir, "latest")
                with open(f"{latest}.tmp", "w") as fh:
                    fh.write(tag)
                os.replace(f"{latest}.tmp", latest)
        dist.barrier()
        return True
