"""ds_chimera's schedules behind Megatron-Core's forward-backward contract.

- :func:`get_forward_backward_func` returns Megatron's contract for any synchronous schedule.
- :func:`build_model_chunks` builds the chunks a schedule places on this rank from a
  ``model_provider`` (two replicas' stages for Chimera, V-shapes for zbv and dualpipev).
- :func:`install` (or ``ds-chimera launch --pipeline-schedule NAME``) makes Megatron's own
  ``get_forward_backward_func()`` return the chosen schedule.
- :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`sharded_state_dict`: Megatron's
  distributed checkpoints of a chunk list, for every schedule, loadable into any layout.
- :func:`enable_cpu` lets Megatron-Core's models run on CPU for tests and examples.
"""
from .checkpoint import load_checkpoint, save_checkpoint, sharded_state_dict
from .cpu import causal_mask, enable_cpu
from .install import install, uninstall
from .contract import get_forward_backward_func
from .stages import build_model_chunks, virtual_stages

__all__ = ["get_forward_backward_func", "build_model_chunks", "install", "uninstall", "enable_cpu", "causal_mask",
           "virtual_stages", "save_checkpoint", "load_checkpoint", "sharded_state_dict"]
