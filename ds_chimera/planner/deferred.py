"""``"schedule": "auto"`` for scripts that give their data only to ``train_batch`` / ``eval_batch``.

Megatron-DeepSpeed's ``pretrain_gpt.py`` and DeepSpeed's own tests pass no ``training_data`` to
``deepspeed.initialize``: the first micro-batch the planner could time the layers on exists only at
the first call. So ``initialize`` returns an engine built under a provisional plan (1F1B on the
module's own cut: what the stock engine runs, so a stock checkpoint loaded before that call fits it),
and the first ``train_batch`` or ``eval_batch``:

1. takes its first micro-batch on rank 0 (and its tensor group), after the engine's ``batch_fn``, and keeps it
   for the call;
2. profiles and plans exactly as ``initialize`` does with ``training_data`` (a failure on rank 0 alone is
   raised on every rank; one that strands the others in a collective, such as a tensor rank's while its group
   profiles, ends every rank within seconds through the fault monitor, naming it);
3. builds the engine of the chosen plan on the same module, as ``initialize`` would have, and moves it
   into the engine object the script holds (what the script set on it since: ``batch_fn``, the data
   iterator, the batch size, comes along); a stock checkpoint loaded into the provisional engine is
   loaded again into the new one;
4. runs the call, and every later one, under the plan.

A ds_chimera checkpoint loaded before the first call decides instead: its optimizer state fits only
the plan it was written under, so the engine is rebuilt under that plan (schedule, options, cut),
and the run continues as the one that wrote it (:meth:`DeferredPlan.adopt`).

Both builds leave the random streams as they found them, so the run is the one that names the chosen
plan from the start. The optimizer instance the script passed is rebuilt in place (the object
``initialize`` returned stays the live one, and a scheduler bound to it keeps driving it); an optimizer
or scheduler DeepSpeed builds from the config is built anew: read them from the engine
(``engine.optimizer``, ``engine.lr_scheduler``) after the first call.
"""
from __future__ import annotations

import contextlib

import torch

from ..logs import get_logger
from .profile import rng_devices

log = get_logger()

# what a script sets on the engine between initialize and the first call, carried to the planned engine
CARRIED = ("batch_fn", "training_dataloader", "monitor", "data_post_process_func")


class DeferredPlan:
    """What the first ``train_batch`` / ``eval_batch`` needs to plan and rebuild (see the module's text)."""

    def __init__(self, build, pipeline, config: dict, optimizer, host_cost=None, guard=None):
        self.build = build              # pipeline config -> (engine, optimizer, loader, scheduler), initialize's rest
        self.pipeline = pipeline        # the "auto" section, with its options
        self.config = config
        self.optimizer = optimizer      # the script's optimizer argument (for the planner's state bytes)
        self.host_cost = host_cost      # the runtime's host time per action, measured with the links
        self.guard = guard              # the runtime's fault guard (runtime.faults.guard): a rank's failure ends all
        self.loads = []                 # load_checkpoint calls made on the provisional engine, replayed

    @staticmethod
    def provisional(module, pipeline):
        """1F1B on the module's own cut."""
        return pipeline.with_plan({"schedule": "1f1b", "parts": [int(p) for p in module.parts]})

    def plan_and_rebuild(self, engine, data_iter) -> None:
        """Steps 1-3 above, on every rank; afterwards ``engine`` is the planned engine."""
        import torch.distributed as dist

        from .deepspeed import ON_RANK0, _on_rank0_for_all, profiling_ranks, resolve
        iterator = data_iter if data_iter is not None else getattr(engine, "_given_iterator", None)
        first = [None]
        # rank 0's tensor group profiles with it; its ranks other than 0 may have no data of their own, their
        # batch_fn receiving rank 0's (Megatron-DeepSpeed's get_batch_pipe), as the stock engine allows
        profilers = profiling_ranks(engine.grid)
        fed_by_tensor_rank0 = engine.batch_fn is not None and len(profilers) > 1

        def take_first():
            if iterator is None and not (fed_by_tensor_rank0 and dist.get_rank() != 0):
                raise ValueError("the first train_batch/eval_batch has no data: pass data_iter, or call "
                                 "set_dataiterator/set_dataloader first")
            batch = next(iterator) if iterator is not None else None
            if engine.batch_fn is not None:
                batch = engine.batch_fn(batch)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError("pipeline batches must be (inputs, labels) pairs, as DeepSpeed's; got "
                                 f"{type(batch).__name__}")
            first[0] = batch
            return {"ok": True}
        # a rank's failure here (a tensor rank's, in a collective with rank 0) ends every rank (runtime.faults)
        def guard():
            if self.guard is None:
                return contextlib.nullcontext()
            return self.guard('"schedule": "auto" (profiling and planning at the first call)', self.pipeline.timeout_s,
                              engine._fault_epoch)
        with guard():
            # the batch_fn of a tensor rank fed by tensor rank 0 receives its batch in a collective
            _on_rank0_for_all(take_first, "taking the first micro-batch to profile", dist, also=profilers,
                              together=fed_by_tensor_rank0)
        micro_batch = first[0] if dist.get_rank() in profilers else ON_RANK0
        if dist.get_rank() == 0:
            log.info("schedule auto: planning at the first call, on its first micro-batch")
        pipeline = resolve(engine.module, self.pipeline, self.config, optimizer=self.optimizer,
                           micro_batch=micro_batch, host_cost=self.host_cost, guard=guard)
        self._rebuild(engine, pipeline, iterator)
        if first[0] is not None:
            engine._pending_batches.append(first[0])       # the profiled micro-batch is the call's first

    def adopt(self, engine, saved: dict, where: str) -> None:
        """Rebuild ``engine`` under the plan of a ds_chimera checkpoint (its layout file, ``saved``)."""
        import torch.distributed as dist
        here = {"stages": engine.num_stages, "data_parallel": engine.dp_size}
        if any(saved.get(key) != value for key, value in here.items()):
            raise ValueError(f"checkpoint {where} was written on {saved.get('stages')} pipeline stages x "
                             f"{saved.get('data_parallel')} data-parallel, and this run has {here['stages']} x "
                             f"{here['data_parallel']}: its optimizer state does not map onto this run. Load the "
                             f"weights only: load_checkpoint(..., load_optimizer_states=False, "
                             f"load_lr_scheduler_states=False)")
        section = {"schedule": saved["schedule"], **saved.get("options", {}), "parts": saved["parts"]}
        if dist.get_rank() == 0:
            log.info("schedule auto: checkpoint %s was written under %r (parts %s): the run continues under that "
                     "plan (its optimizer state fits no other)", where, saved["schedule"], saved["parts"])
        self._rebuild(engine, self.pipeline.with_plan(section), getattr(engine, "_given_iterator", None))

    def _rebuild(self, engine, pipeline, iterator) -> None:
        carried = {k: engine.__dict__[k] for k in CARRIED if k in engine.__dict__}
        batch_size = engine.train_batch_size()
        scheduler = engine.lr_scheduler
        with torch.random.fork_rng(devices=rng_devices(engine.device)):
            planned = self.build(pipeline)[0]
        engine.__dict__ = planned.__dict__       # one state, both objects: the script's holds the planned engine
        engine.__class__ = type(planned)         # an asynchronous plan (allow_asynchronous) runs its own engine
        engine.__dict__.update(carried)
        if engine.train_batch_size() != batch_size:
            engine.set_train_batch_size(batch_size)
        if iterator is not None:
            engine.set_dataiterator(iterator)
        for args, kwargs in self.loads:
            if engine.lr_scheduler is scheduler and scheduler is not None:
                # the script's scheduler instance, now driving the planned engine, holds the loaded state
                # already (a second load would count Megatron's steps twice)
                kwargs = dict(kwargs, load_lr_scheduler_states=False)
            engine.load_checkpoint(*args, **kwargs)


