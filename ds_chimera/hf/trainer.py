"""``PipelineTrainer``: a ``transformers.Trainer`` whose steps run a ds_chimera pipeline schedule.

HF's own training loop runs unchanged (dataloader, epochs, ``num_items_in_batch``,
logging cadence, callbacks, evaluation, checkpoints, resuming); a few of its hooks are
pointed at the pipeline engine:

- ``training_step`` collects the step's accumulation batches and, at the last one, runs
  them as the schedule's N micro-batches in one ``engine.train_batch`` (which also syncs,
  clips and steps); the loss is weighted to be exactly the Trainer's (:mod:`.data`);
- the optimizer is the Trainer's own, rebuilt over the pipeline's parameters (:mod:`.optim`);
  its scheduler is stepped by HF's loop, so ``learning_rate`` is logged as HF logs it;
- ``prediction_step`` runs eval batches through the schedule's forward passes
  (:mod:`.evaluation`); ``compute_metrics`` sees every prediction on every rank;
- checkpoints add the engine's state and are written atomically (:mod:`.checkpoint`); a plain
  one-process Trainer resumes them exactly too (:mod:`.plain_resume`).

From the Trainer's point of view the run is one process holding the global batch
(:mod:`.accel`); which rank logs and saves follows HF's ``should_log`` / ``should_save``.
An unchanged ``Trainer`` becomes this class when ds_chimera is imported (:mod:`.routing`).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import Trainer

from .accel import OneProcessView
from .args import pipeline_config_of, true_ranks
from .build import build_engine, profile_micro_batch
from .checkpoint import begin, commit, load_pipeline_state, save_pipeline_state
from .checks import check_model_fits, check_trainable
from .config import checkpoint_interval, resolve
from .convert import to_pipeline
from .data import check_batch, train_micro_batches
from .evaluation import predict_batch
from .export import gather_layer_states, hf_state_dict, load_into
from .layout import describe
from .loss import PipelineLoss
from .optim import EngineScheduler, EngineStepped, torch_optimizer
from .overrides import refuse_overrides
from .plain_resume import save_plain_rng
from .rng import ComputeRNG

UNSUPPORTED = {"model_init": "pass a model (hyperparameter search re-creates models, which a pipeline cannot)",
               "compute_loss_func": "the loss is the causal-LM loss of ds_chimera.hf, computed on the last stage"}


def _world() -> tuple:
    """(rank, world size) of the initialised process group, else of the launcher's environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _refuse(cls, model, args, kwargs) -> None:
    """What the constructor cannot honour, before any work."""
    refuse_overrides(cls, PipelineTrainer)
    for key, fix in UNSUPPORTED.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"a pipelined Trainer does not take {key}=...; {fix}")
    optimizers = kwargs.get("optimizers") or (None, None)
    if optimizers[1] is not None:
        raise ValueError("a pipelined Trainer rebuilds the optimizer over the pipeline's stages, so a scheduler "
                         "instance bound to yours would not drive it: pass optimizers=(optimizer, None) and set "
                         "lr_scheduler_type, or configure a \"scheduler\" in the DeepSpeed config")
    if model is None or args is None:
        raise ValueError("a pipelined Trainer needs model= (an HF causal LM) and args= (TrainingArguments with "
                         "deepspeed= a config with a \"pipeline\": {\"schedule\": NAME} section)")
    if pipeline_config_of(args.deepspeed) is None:
        raise ValueError("PipelineTrainer needs TrainingArguments(deepspeed=CONFIG) with a \"pipeline\": "
                         f"{{\"schedule\": NAME}} section (e.g. {{\"pipeline\": {{\"schedule\": \"chimera\"}}}}); "
                         f"got {args.deepspeed!r}")


class PipelineTrainer(Trainer):
    """A Trainer for HF causal LMs on a pipeline schedule (see the module docstring).

    Extra keywords: ``partition_method`` (how layers are cut into stages, DeepSpeed's:
    ``parameters``, ``uniform`` or ``type:REGEX``), ``activation_checkpoint_interval`` and
    ``update_model`` (copy the trained weights back into ``trainer.model`` after ``train()``,
    default True).
    """

    def __init__(self, model=None, args=None, *, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, update_model: bool = True, **kwargs):
        _refuse(type(self), model, args, kwargs)
        rank, world = _world()
        # arguments built before ds_chimera was imported still learn the true ranks (who logs and saves)
        true_ranks(getattr(args, "distributed_state", None))
        self.layout = describe(model)                              # unconvertible model: fails here
        self.setup = resolve(args.deepspeed, args, world)          # batch keys, ZeRO, schedule limits
        check_model_fits(self.layout, self.setup, world)           # enough layers for the stages
        check_trainable(model)
        self.layer_specs = to_pipeline(model)                      # (then a numerical check for pp_plan models)
        self.partition_method = partition_method
        # HF's --activation_checkpointing / --gradient_checkpointing: every layer recomputed
        self.activation_checkpoint_interval = checkpoint_interval(args, activation_checkpoint_interval)
        self.update_model = update_model
        self.engine = self.hf_optimizer = None
        self.pipeline_loss = PipelineLoss()
        self.compute_rng = ComputeRNG(args.seed, rank)
        self._pending, self._mask = [], None
        self._step_grad_norm = None
        self._step_skipped = False           # the engine skipped the last step (fp16 overflow)
        self._staging = None
        super().__init__(model=model, args=args, **kwargs)
        # HF's own DeepSpeed paths (deepspeed_init, DeepSpeed saving) must never run: the engine is ours
        self.is_deepspeed_enabled = False

    # ---- the Trainer sees one process holding the global batch ---------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = OneProcessView(self.accelerator, step_skipped=lambda: self._step_skipped)
        self.gather_function = self.accelerator.gather_for_metrics

    def get_train_dataloader(self):
        if self.setup.data_parallel == 1:
            return super().get_train_dataloader()
        # with data parallelism a "batch" is the rows of all replicas, dealt out in training_step
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self._train_batch_size * self.setup.data_parallel,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def get_total_train_batch_size(self, args) -> int:
        return self.setup.global_batch

    def store_flos(self) -> None:
        # every rank counted the same global batches: the single-process total, not a sum over ranks
        self.state.total_flos += self.current_flos
        self.current_flos = 0

    @property
    def dp_rank(self) -> int:
        return self.engine.grid.get_data_parallel_id()

    @property
    def engine_owns_scheduler(self) -> bool:
        return "scheduler" in self.setup.config

    def _uses_mask(self, batch) -> bool:
        check_batch(batch)
        has = "attention_mask" in batch
        if self._mask is None:
            self._mask = has
        if has != self._mask:
            raise ValueError("the collator returned attention_mask for some batches and not for others; the pipeline "
                             "sends one structure between stages: make it return one always or never")
        return has

    # ---- the engine ----------------------------------------------------------------------------
    def _ensure_engine(self, max_steps: int | None = None):
        """Build the PipelineModule and engine once (collective: every rank)."""
        if self.engine is None:
            # "schedule": "auto": the planner times the layers on the data's first micro-batch, read from the
            # data side's random stream (as training will read it) and leaving it where it was
            profile = profile_micro_batch(self) if self.setup.pipeline.planned else None
            with self.compute_rng.active():
                self.engine = build_engine(self, max_steps, profile)
            self.optimizer = EngineStepped(self.engine.optimizer)
            self.model_wrapped = self.engine
        return self.engine

    def _planned_max_steps(self) -> int:
        """The number of training steps, for a config scheduler built before training (evaluation first)."""
        if self.train_dataset is None:
            raise ValueError("the DeepSpeed config's \"scheduler\" needs the number of training steps: pass "
                             "train_dataset (or set its total_num_steps) before evaluating")
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """HF's hook between data and loop: the engine instead of accelerate.prepare(model, optimizer)."""
        if self._created_lr_scheduler:
            self.lr_scheduler, self._created_lr_scheduler = None, False
        engine = self._ensure_engine(max_steps)
        if self.engine_owns_scheduler:
            self.lr_scheduler = EngineScheduler(engine)
        else:
            self.create_scheduler(num_training_steps=max_steps, optimizer=torch_optimizer(engine.optimizer))
        if self.model not in self.accelerator._models:
            self.accelerator._models.append(self.model)     # as accelerate.prepare would have
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        self._pending = []
        return self.model, train_dataloader

    # ---- training ------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Collect the step's batches; at the last one, run the whole step through the schedule."""
        self._uses_mask(inputs)
        self._pending.append(inputs)
        device = self.args.device
        if len(self._pending) < self.current_gradient_accumulation_steps:
            return torch.zeros((), device=device)
        batches, self._pending = self._pending, []
        setup = self.setup
        pairs = train_micro_batches(batches, setup.micro_batches, setup.data_parallel, self.dp_rank,
                                    num_items_in_batch, len(batches), self._mask)
        skipped_before = self.engine.skipped_steps
        with self.compute_rng.active():
            loss = self.engine.train_batch(iter(pairs))
        self._step_skipped = self.engine.skipped_steps > skipped_before
        self._step_grad_norm = getattr(self.engine, "_global_grad_norm", None)
        return loss.detach().reshape(()).to(device)

    def _clip_grad_norm(self, model):
        return self._step_grad_norm          # the engine clipped; this is the norm before clipping

    def _get_grad_norm(self, model, grad_norm=None):
        return self._step_grad_norm if grad_norm is None else grad_norm

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise RuntimeError("ds_chimera: a pipelined Trainer computes the loss on the last pipeline stage; "
                           "compute_loss is not called")

    def _finalize_training(self, trial, num_train_samples, start_time):
        if self.update_model:
            load_into(self.model, gather_layer_states(self.engine, dst=None))
        return super()._finalize_training(trial, num_train_samples, start_time)

    # ---- evaluation and prediction -------------------------------------------------------------
    def evaluation_loop(self, *args, **kwargs):
        """HF's loop; the logits are preprocessed where they are (the last stages), not after the step."""
        self._ensure_engine()
        preprocess, self.preprocess_logits_for_metrics = self.preprocess_logits_for_metrics, None
        self.pipeline_loss.preprocess = preprocess
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.preprocess_logits_for_metrics = preprocess
            self.pipeline_loss.preprocess = None

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        if has_labels and self.label_names != ["labels"]:
            raise ValueError(f"a pipelined Trainer scores the 'labels' column; label_names={self.label_names}")
        loss, predictions = predict_batch(self, inputs, has_labels, not prediction_loss_only)
        if prediction_loss_only:
            return loss, None, None
        return loss, predictions, (inputs["labels"].detach() if has_labels else None)

    # ---- saving and resuming -------------------------------------------------------------------
    def save_model(self, output_dir=None, _internal_call: bool = False) -> None:
        """An HF checkpoint (config.json + safetensors) of the trained weights. Collective once trained."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        states = gather_layer_states(self.engine, dst=None if self.args.save_on_each_node else 0)
        state_dict = hf_state_dict(self.layout, states) if states is not None else None
        self._save(output_dir, state_dict=state_dict)        # HF's: weights, tokenizer, training_args.bin
        dist.barrier()

    def _get_output_dir(self, trial):
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """HF's checkpoint, staged and renamed whole (see :mod:`.checkpoint`)."""
        run_dir = super()._get_output_dir(trial)
        name, writer = f"checkpoint-{self.state.global_step}", self.args.should_save
        self._staging = begin(run_dir, name, writer)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            staging, self._staging = self._staging, None
        final = commit(staging, run_dir, name, writer)
        best = self.state.best_model_checkpoint
        if best is not None and best.startswith(staging):
            self.state.best_model_checkpoint = final + best[len(staging) + len(name) + 1:]
            if writer:
                self.state.save_to_json(os.path.join(final, "trainer_state.json"))
        if writer:
            from transformers.trainer_utils import rotate_checkpoints
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        dist.barrier()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_pipeline_state(self, output_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        save_plain_rng(self, output_dir)          # rng_state.pth too, for a one-process Trainer's resume

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is not None:
            load_pipeline_state(self, checkpoint)
