"""What set-up hands the engine, and the one place where DeepSpeed is made to build our engine.

``deepspeed.initialize`` builds its pipeline engine itself, from a module-level name
(``deepspeed.PipelineEngine``), with a fixed set of keyword arguments: there is no argument through
which set-up could pass what it built. So for the length of one ``initialize`` call that name is
bound to our engine class with the prepared pipeline already applied
(:func:`deepspeed_builds`), under a process-wide lock: the engine's constructor receives the
:class:`PreparedPipeline` as a declared keyword argument, and nothing travels on the user's module
but its own layers (the chunks are its submodules, so DeepSpeed's engine sees their parameters).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:     # annotations only: importing this module stays free of torch and DeepSpeed
    from torch import nn

    from .plan import Plan
    from .sharding import ChunkShards

_LOCK = threading.Lock()


@dataclass
class PreparedPipeline:
    """This rank's pipeline as :func:`~.setup.prepare_module` built it, for the engine's constructor."""

    plan: Plan                        # schedule, lowered programs, cut, options (the stock optimizer layout)
    chunks: list                      # this rank's chunk modules (also module.ds_chimera_chunks)
    tied: nn.ModuleDict               # the tied layers this rank holds, by key
    shards: ChunkShards | None        # ZeRO-2/3: this rank's slices of its chunks; None otherwise
    # model_parameters (or an optimizer's param_groups) -> the chunks' groups: see runtime/param_groups.py
    regroup: Callable


@contextlib.contextmanager
def deepspeed_builds(engine_class, prepared: PreparedPipeline | None = None, name: str = "PipelineEngine"):
    """Within the block, ``deepspeed.initialize`` builds ``engine_class`` where it would build its ``name``
    class, given ``prepared=`` when there is a prepared pipeline (Wavelet's engine takes none)."""
    import deepspeed
    factory = functools.partial(engine_class, prepared=prepared) if prepared is not None else engine_class
    with _LOCK:
        saved = getattr(deepspeed, name)
        setattr(deepspeed, name, factory)
        try:
            yield
        finally:
            setattr(deepspeed, name, saved)
