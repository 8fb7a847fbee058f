"""The entry point of Megatron's forward-backward contract: a function for a schedule name.

It picks the runner (:class:`~.runner.ScheduleRunner` for a named schedule, :class:`~.auto.AutoRunner`
for ``"auto"``) and wraps it in a function with Megatron-Core's signature.
"""
from __future__ import annotations

from ..config import DEFAULT_TIMEOUT_S, PipelineConfig
from .auto import AutoRunner
from .runner import ScheduleRunner


def get_forward_backward_func(schedule: str = "1f1b", *, timeout: float = DEFAULT_TIMEOUT_S, **options):
    """A function with Megatron-Core's forward-backward contract that runs ``schedule``.

    ``options`` are the schedule's own (``chunks=V`` for interleaved and breadth-first,
    ``pipelines`` for chimera...); ``"auto"`` times the first training call, then runs the fastest
    schedule for the chunks as built (:mod:`.auto`; options ``max_activations``, ``plan_file``).
    ``timeout`` (seconds) bounds every wait on a peer: a dead rank becomes a clear error. Bad names and options fail here, before any step.
    """
    return forward_backward_func_for(PipelineConfig.from_megatron(schedule, {**options, "timeout": timeout}))


def forward_backward_func_for(config: PipelineConfig):
    """:func:`get_forward_backward_func` for an already parsed configuration (``"auto"``: :mod:`.auto`)."""
    runner = AutoRunner(config) if config.planned else ScheduleRunner(config)

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

    forward_backward_func.schedule = config.schedule
    forward_backward_func.options = dict(config.options)
    forward_backward_func.config = config
    forward_backward_func.runner = runner          # under "auto": its decisions and the planner's reports
    return forward_backward_func
