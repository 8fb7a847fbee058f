"""``eval_batch`` with the stock engine's other arguments: logits, outputs without a loss, per-micro-batch
results, another micro-batch count.

The stock engine computes every micro-batch's last stage on one rank (stage D-1), so it reads
results there. Under a ds_chimera schedule a micro-batch ends on whichever rank holds its route's
last chunk (Chimera's up pipeline ends on rank 0), so each rank records what its last chunks
produce, and the records are gathered onto the rank DeepSpeed calls the last stage. From there
the stock engine's rules apply: ``reduce_output="avg"`` averages over micro-batches and the
data-parallel group, ``None`` keeps the list; losses go to every pipeline rank when ``bcast_loss``
(a list too, where the stock engine fails); ``return_logits`` adds the last micro-batch's outputs
on the last stage, ``None`` elsewhere.

The training step never goes through here: the default ``eval_batch`` arguments keep the
engine's all-reduced loss, and this path wraps the host instead of adding a test to its loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .tensors import to_device

REDUCTIONS = ("avg", None)


def check_eval_arguments(reduce_output, num_micro_batches) -> None:
    """Bad arguments are refused before any work, naming what is allowed."""
    if not (reduce_output is None or (isinstance(reduce_output, str) and reduce_output.lower() == "avg")):
        raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
    if num_micro_batches is not None and (isinstance(num_micro_batches, bool) or
                                          not isinstance(num_micro_batches, int) or num_micro_batches < 1):
        raise ValueError(f"eval_batch: num_micro_batches must be a positive integer or None, got "
                         f"{num_micro_batches!r}")


class RecordingHost:
    """The host, with the last chunks' results recorded per micro-batch (``loss_fn`` applied or not)."""

    def __init__(self, host, compute_loss: bool, keep_output_of: int | None):
        self._host, self._compute_loss, self._keep = host, compute_loss, keep_output_of
        self.values: dict = {}           # micro-batch -> loss, or output where compute_loss is False
        self.output = None               # the kept micro-batch's output, where this rank computed it

    def __getattr__(self, name):
        return getattr(self._host, name)

    def loss(self, output, chunk: int, mb: int):
        host = self._host
        value = host.loss(output, chunk, mb) if self._compute_loss else output
        self.values[mb] = _detached(value)
        if mb == self._keep:
            self.output = _detached(output)
        return value


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


def _cpu(value):
    return to_device(value, "cpu")


def collect(engine, recorded: RecordingHost, micro_batches: int, return_logits: bool):
    """Every rank's records, on the last stage's rank: (values by micro-batch, kept output); others (None, None).

    One object gather over the pipeline group (results travel on the CPU: an object collective
    unpickles a device tensor on the sender's device index)."""
    group = engine.grid.get_pipe_parallel_group()
    last = engine._loss_stage_global_rank()
    mine = ({mb: _cpu(v) for mb, v in recorded.values.items()},
            _cpu(recorded.output) if return_logits and recorded.output is not None else None)
    received = [None] * dist.get_world_size(group) if engine.global_rank == last else None
    dist.gather_object(mine, received, dst=last, group=group)
    if engine.global_rank != last:
        return None, None
    values, output = {}, None
    for part, kept in received:
        values.update(part)
        output = kept if kept is not None else output
    if sorted(values) != list(range(micro_batches)):
        raise RuntimeError(f"internal error: eval results for micro-batches {sorted(values)}, expected "
                           f"0..{micro_batches - 1}")
    device = engine.device
    return [to_device(values[mb], device) for mb in range(micro_batches)], to_device(output, device)


def reduce_outputs(engine, values: list, reduce_output, micro_batches: int):
    """The stock engine's reduction on the last stage: the list, or its mean over micro-batches and
    data-parallel replicas (tensors, or tuples of tensors elementwise)."""
    if reduce_output is None:
        return values
    if isinstance(values[0], torch.Tensor):
        mean = sum(values) / micro_batches
        parts, single = [mean], True
    else:
        parts = [sum(v[i] for v in values) / micro_batches for i in range(len(values[0]))]
        single = False
    if engine.dp_size > 1:
        for part in parts:
            dist.all_reduce(part, group=engine.grid.get_data_parallel_group())
            part /= engine.dp_size
    return parts[0] if single else type(values[0])(parts)


def broadcast_losses(engine, result, reduce_output, micro_batches: int):
    """The last stage's loss (or per-micro-batch losses) on every pipeline rank of the replica."""
    group, last = engine.grid.get_pipe_parallel_group(), engine._loss_stage_global_rank()
    count = micro_batches if reduce_output is None else 1
    buffer = torch.zeros(count, dtype=torch.float32, device=engine.device)
    if engine.global_rank == last:
        flat = torch.stack([v.reshape(()) for v in result]) if reduce_output is None else result.reshape(1)
        buffer.copy_(flat.float())
    dist.broadcast(buffer, src=last, group=group)
    if reduce_output is None:
        return list(buffer.unbind(0))
    return buffer.squeeze(0)
