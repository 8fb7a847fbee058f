"""``PipelineTrainer``: a ``transformers.Trainer`` whose steps run a ds_chimera pipeline schedule.

The model is converted with :func:`to_pipeline`, and ``TrainingArguments(deepspeed=...)``'s
config picks the schedule. The training loop is replaced (one ``engine.train_batch`` per
step: the schedule runs all N micro-batches, syncs, clips and steps), but the Trainer's own
machinery drives it: ``TrainerState``, the callbacks (``on_step_end`` decides logging,
evaluation, saving and stopping), ``self.log`` and ``state.log_history``.

Launch it on all ranks (``torchrun`` / ``deepspeed``); every rank builds only the chunks
its schedule places on it. Rank identity comes from torch.distributed, because accelerate
reports one process for DeepSpeed on CPU.
"""
from __future__ import annotations

import math
import os
import time

import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import TrainOutput, rotate_checkpoints, speed_metrics

from .config import fill_scheduler, resolve
from .convert import to_pipeline
from .data import Batches, epoch_order
from .export import export_pretrained, gather_layer_states, load_into
from .layout import describe, pipeline_hf_names
from .loss import causal_lm_loss

UNSUPPORTED = {"model_init": "pass a model", "compute_loss_func": "the loss is the causal-LM loss of ds_chimera.hf",
               "compute_metrics": "evaluate() reports eval_loss only (the logits stay on the last stage)",
               "preprocess_logits_for_metrics": "evaluate() reports eval_loss only (the logits stay on the last stage)",
               "optimizers": "configure the optimizer in TrainingArguments or the DeepSpeed config",
               "optimizer_cls_and_kwargs": "configure the optimizer in TrainingArguments or the DeepSpeed config"}


def _world() -> tuple:
    """(rank, world size, local rank) from torch.distributed, else from the launcher's environment."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return rank, world, int(os.environ.get("LOCAL_RANK", 0))


class PipelineTrainer(Trainer):
    """Trainer for HF causal LMs on a pipeline schedule (see the module docstring).

    Extra keywords: ``partition_method`` (how layers are cut into stages, DeepSpeed's:
    ``parameters``, ``uniform`` or ``type:REGEX``), ``activation_checkpoint_interval``,
    ``shuffle`` (seeded per epoch, default True) and ``update_model`` (copy the trained
    weights back into ``trainer.model`` after ``train()``, default True).
    """

    def __init__(self, model=None, args=None, *, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, shuffle: bool = True, update_model: bool = True, **kwargs):
        for key, fix in UNSUPPORTED.items():
            if kwargs.get(key) not in (None, (None, None)):
                raise ValueError(f"PipelineTrainer does not take {key}=...; {fix}")
        if model is None or args is None:
            raise ValueError("PipelineTrainer needs model= (an HF causal LM) and args= (TrainingArguments with deepspeed=)")
        if not args.deepspeed:
            raise ValueError("PipelineTrainer needs TrainingArguments(deepspeed=CONFIG) with a \"pipeline\": "
                             "{\"schedule\": NAME} section (e.g. configs/chimera.json)")
        self.layout = describe(model)                              # unconvertible model: fails here
        _, world, _ = _world()
        self.setup = resolve(args.deepspeed, args, world)          # bad batch / ZeRO / schedule: fails here
        self.layer_specs = to_pipeline(model)                      # (then a numerical check for pp_plan models)
        from ..schedules import registry
        if self.layout.tied and not registry.get(self.setup.schedule).synchronous:
            raise ValueError(f"schedule {self.setup.schedule!r} updates stages on their own clocks and cannot keep "
                             f"{self.layout.model_class}'s tied embedding and head equal; use a synchronous schedule "
                             f"or a model with tie_word_embeddings=False")
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.shuffle, self.update_model = shuffle, update_model
        self.engine = None
        super().__init__(model=model, args=args, **kwargs)

    # ---- ranks (accelerate's view is wrong for DeepSpeed on CPU) -----------------------------
    def is_world_process_zero(self) -> bool:
        return _world()[0] == 0

    def is_local_process_zero(self) -> bool:
        return _world()[2] == 0

    # ---- the engine ---------------------------------------------------------------------------
    def _max_steps(self) -> tuple:
        """(max_steps, steps per epoch, epochs) from the train dataset and the arguments."""
        if self.train_dataset is None:
            raise ValueError("PipelineTrainer.train() needs train_dataset")
        batches = self._batches(self.train_dataset, self.setup.micro_batch)
        per_epoch = len(self.train_dataset) // batches.size
        if per_epoch == 0:
            raise ValueError(f"train_dataset has {len(self.train_dataset)} samples, fewer than one global batch of "
                             f"{batches.size} (per_device_train_batch_size {self.setup.micro_batch} x "
                             f"{self.setup.micro_batches} micro-batches x data-parallel {self.setup.data_parallel})")
        if self.args.max_steps > 0:
            steps = self.args.max_steps
        else:
            steps = math.ceil(self.args.num_train_epochs * per_epoch)
        return steps, per_epoch, math.ceil(steps / per_epoch)

    def _ensure_engine(self, max_steps: int | None = None):
        """Build the PipelineModule and ds_chimera engine once (collective: every rank)."""
        if self.engine is not None:
            return self.engine
        import deepspeed
        from deepspeed.pipe import PipelineModule

        from ..integrations.deepspeed import initialize
        if max_steps is None:
            max_steps = self._max_steps()[0] if self.train_dataset is not None else max(self.args.max_steps, 1)
        deepspeed.init_distributed(dist_backend=None)
        config = dict(self.setup.config)
        fill_scheduler(config, self.args, max_steps)
        net = PipelineModule(layers=self.layer_specs, num_stages=self.setup.stages, loss_fn=causal_lm_loss,
                             partition_method=self.partition_method, dynamic_shape=True,
                             activation_checkpoint_interval=self.activation_checkpoint_interval)
        optimizer = None if "optimizer" in config else self._optimizer_factory(net)
        scheduler = None if "scheduler" in config else self._scheduler_factory(max_steps)
        engine, _, _, _ = initialize(model=net, config=config, optimizer=optimizer, lr_scheduler=scheduler)
        self.engine = engine
        self.optimizer, self.lr_scheduler = engine.optimizer, engine.lr_scheduler
        self.model_wrapped = engine
        return engine

    def _optimizer_factory(self, net):
        """The optimizer TrainingArguments describe, with HF's weight-decay groups, over the chunks' parameters."""
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
        decay = set(self.get_decay_parameter_names(self.model))
        layout, weight_decay = self.layout, self.args.weight_decay

        def make(params):
            names = pipeline_hf_names(net.ds_chimera_chunks, layout)
            params = list(params)
            groups = [{"params": [p for p in params if names.get(id(p)) in decay], "weight_decay": weight_decay},
                      {"params": [p for p in params if names.get(id(p)) not in decay], "weight_decay": 0.0}]
            return cls([g for g in groups if g["params"]], **kwargs)
        return make

    def _scheduler_factory(self, max_steps: int):
        from transformers.optimization import get_scheduler
        args = self.args

        def make(optimizer):
            return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(max_steps),
                                 num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
        return make

    def _batches(self, dataset, micro: int) -> Batches:
        return Batches(dataset, self.data_collator, micro, self.setup.micro_batches, self.setup.data_parallel,
                       seed=self.args.seed)

    def _dp_rank(self) -> int:
        return self.engine.grid.get_data_parallel_id()

    # ---- training -----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Train for ``max_steps`` (or ``num_train_epochs``) steps of one global batch each."""
        if resume_from_checkpoint not in (None, False):
            raise ValueError("PipelineTrainer cannot resume_from_checkpoint yet; load the pipeline state with "
                             "trainer.engine.load_checkpoint(<checkpoint-N>/pipeline) after building the engine")
        if trial is not None or kwargs:
            raise ValueError(f"PipelineTrainer.train() takes no trial or extra arguments, got {sorted(kwargs) or 'trial'}")
        args = self.args
        max_steps, per_epoch, epochs = self._max_steps()
        engine = self._ensure_engine(max_steps)
        batches = self._batches(self.train_dataset, self.setup.micro_batch)
        self.is_in_train = True
        self.state = TrainerState(stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control]
                                                      if isinstance(cb, ExportableState)])
        self.state.train_batch_size = self.setup.micro_batch
        self.state.compute_steps(args, max_steps)
        self.state.init_training_references(self, max_steps, epochs, None)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        start = time.time()
        self._since_log, self._logged_at, total_loss = 0.0, 0, 0.0
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        seed = args.data_seed if args.data_seed is not None else args.seed
        for epoch in range(epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            steps = batches.train_steps(epoch_order(len(self.train_dataset), seed, epoch, self.shuffle))
            for k, indices in enumerate(steps):
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                data, _, tokens = batches.step(indices, self._dp_rank())
                loss = engine.train_batch(iter(data)).item()
                total_loss += loss
                self._since_log += loss
                self.state.global_step += 1
                self.state.epoch = epoch + (k + 1) / len(steps)
                self.state.num_input_tokens_seen += tokens
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                self._log_save_evaluate(start, ignore_keys_for_eval)
                if self.control.should_training_stop or self.state.global_step >= max_steps:
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_save_evaluate(start, ignore_keys_for_eval)
            if self.control.should_training_stop or self.state.global_step >= max_steps:
                break
        done = self.state.global_step
        metrics = speed_metrics("train", start, num_samples=done * self.setup.global_batch, num_steps=done)
        metrics["train_loss"] = total_loss / max(done, 1)
        self.log(metrics)
        if self.update_model:
            load_into(self.model, gather_layer_states(engine, dst=None))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        return TrainOutput(done, metrics["train_loss"], metrics)

    def _log_save_evaluate(self, start: float, ignore_keys) -> None:
        """What the callbacks asked for after a step: log, evaluate, save."""
        if self.control.should_log and self.state.global_step > self._logged_at:
            logs = {"loss": self._since_log / (self.state.global_step - self._logged_at),
                    "learning_rate": float(self.engine.get_lr()[0])}
            norm = getattr(self.engine, "_global_grad_norm", None)
            if norm is not None:
                logs["grad_norm"] = float(norm)
            self._since_log, self._logged_at = 0.0, self.state.global_step
            self.log(logs, start)
        if self.control.should_evaluate:
            self.evaluate(ignore_keys=ignore_keys)
        if self.control.should_save:
            self._save_checkpoint(self.model, None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    # ---- evaluation ---------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Token-mean next-token loss over the whole eval set, run through the schedule's forward passes."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("PipelineTrainer.evaluate() needs eval_dataset (here or in the constructor)")
        if isinstance(dataset, dict):
            raise ValueError("PipelineTrainer.evaluate() takes one eval dataset, not a dict of them")
        engine = self._ensure_engine()
        batches = self._batches(dataset, self.args.per_device_eval_batch_size)
        start, total, tokens = time.time(), 0.0, 0
        steps = batches.eval_steps()
        for indices in steps:
            data, count, _ = batches.step(indices, self._dp_rank())
            loss = engine.eval_batch(iter(data)).item()
            total += loss * count
            tokens += count
        metrics = {f"{metric_key_prefix}_loss": total / tokens if tokens else float("nan")}
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=len(dataset), num_steps=len(steps)))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, *args, **kwargs):
        raise NotImplementedError("PipelineTrainer has no predict(); save_model() and load the HF checkpoint instead")

    # ---- saving -------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An HF checkpoint (config.json + safetensors) of the trained weights. Collective once trained."""
        output_dir = output_dir or self.args.output_dir
        if self.engine is not None:
            export_pretrained(self.engine, self.model, output_dir)
        elif self.is_world_process_zero():
            self.model.save_pretrained(output_dir)
        if self.is_world_process_zero():
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_checkpoint(self, model, trial) -> None:
        """checkpoint-N/: the HF checkpoint, the pipeline's own (optimizer included) under pipeline/, the state."""
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        self.save_model(folder, _internal_call=True)
        self.engine.save_checkpoint(os.path.join(folder, "pipeline"))
        if self.is_world_process_zero():
            self.state.save_to_json(os.path.join(folder, "trainer_state.json"))
            rotate_checkpoints(output_dir=self.args.output_dir, save_total_limit=self.args.save_total_limit,
                               use_mtime=True)
