"""Build the pipeline engine a Trainer runs: its PipelineModule, optimizer and config (collective)."""
from __future__ import annotations

import copy

from .config import fill_scheduler
from .layout import pipeline_hf_names
from .optim import chunk_optimizer_factory


def build_engine(trainer, max_steps: int | None):
    """The ds_chimera engine for ``trainer``; every rank calls this together."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from ..integrations.deepspeed import initialize_pipeline
    setup = trainer.setup
    config = copy.deepcopy(setup.config)
    if isinstance((config.get("scheduler") or {}).get("params"), dict):
        if max_steps is None:
            max_steps = trainer._planned_max_steps()
        fill_scheduler(config, trainer.args, max_steps)
    deepspeed.init_distributed(dist_backend=None)
    net = PipelineModule(layers=trainer.layer_specs, num_stages=setup.stages, loss_fn=trainer.pipeline_loss,
                         partition_method=trainer.partition_method, dynamic_shape=True,
                         activation_checkpoint_interval=trainer.activation_checkpoint_interval)
    optimizer = None
    if "optimizer" not in config:
        hf_optimizer = trainer.create_optimizer()            # the Trainer's own (args, subclass, optimizers=)
        trainer.hf_optimizer = hf_optimizer
        optimizer = chunk_optimizer_factory(hf_optimizer, trainer.model,
                                            lambda: pipeline_hf_names(net.ds_chimera_chunks, trainer.layout))
    pipeline = setup.pipeline.with_clip(setup.engine_clip)   # the norm is reported even when clipping is off
    engine, _, _, _ = initialize_pipeline(pipeline, model=net, config=config, optimizer=optimizer)
    return engine
