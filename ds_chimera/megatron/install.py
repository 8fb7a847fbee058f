"""Make a Megatron training launch run a ds_chimera schedule.

Megatron-LM's training loop asks ``megatron.core.pipeline_parallel.get_forward_backward_func()``
for its schedule. :func:`install` replaces that function (and every already-imported module's
reference to it) with one that returns a ds_chimera schedule chosen by, in order:
``install(schedule=...)``, ``--pipeline-schedule NAME`` on the command line (removed from
``sys.argv`` so Megatron's own parser never sees it), or ``DS_CHIMERA_PIPELINE_SCHEDULE``
(set by ``ds-chimera launch --pipeline-schedule NAME``). Schedule options come from
``--pipeline-schedule-options JSON`` or ``DS_CHIMERA_PIPELINE_OPTIONS``. V, the chunks per
rank of looped schedules, comes from Megatron's own virtual-pipeline setting.
"""
from __future__ import annotations

import json
import os
import sys

from ..config import PipelineConfig
from .choice import ENV_SCHEDULE, chosen_schedule, record_installed, virtual_pipeline_size
from .contract import forward_backward_func_for

_STATE: dict = {}


def _bound(module):
    """A module's own ``get_forward_backward_func`` (its __dict__: some modules' __getattr__ raise)."""
    namespace = getattr(module, "__dict__", None)
    return namespace.get("get_forward_backward_func") if isinstance(namespace, dict) else None


def install(schedule: str | None = None, argv: list | None = None, **options):
    """Route Megatron's ``get_forward_backward_func()`` to ``schedule``; returns the name, or None.

    Without a schedule from any source nothing is patched (Megatron keeps its own).
    """
    import megatron.core.pipeline_parallel as pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    if schedule is None:
        schedule, from_args = chosen_schedule(argv)
        options = {**from_args, **options}
    if schedule is None:
        return None
    config = PipelineConfig.from_megatron(schedule, options, where="install")   # bad name or options: fail now
    original = _STATE.get("original", schedules.get_forward_backward_func)
    cache: dict = {}

    def ds_chimera_get_forward_backward_func(pp_size=None, vp_size=None, **_):
        chosen = config
        virtual = virtual_pipeline_size(vp_size)
        if virtual and virtual > 1:
            chosen = config.with_default_option("chunks", virtual)
        key = json.dumps(dict(chosen.options), sort_keys=True)
        if key not in cache:
            cache[key] = forward_backward_func_for(chosen)
        return cache[key]

    ds_chimera_get_forward_backward_func.ds_chimera_schedule = schedule
    replaced = [f for f in (original, _STATE.get("installed")) if f is not None]   # Megatron's, or our last one
    _STATE["original"] = original
    _STATE["installed"] = ds_chimera_get_forward_backward_func
    record_installed(config)
    for module in list(sys.modules.values()):        # e.g. megatron.training.training imported it by name
        if any(_bound(module) is f for f in replaced):
            setattr(module, "get_forward_backward_func", ds_chimera_get_forward_backward_func)
    pipeline_parallel.get_forward_backward_func = ds_chimera_get_forward_backward_func
    schedules.get_forward_backward_func = ds_chimera_get_forward_backward_func
    return schedule


def uninstall() -> None:
    """Give Megatron its own schedules back."""
    if "original" not in _STATE:
        return
    for module in list(sys.modules.values()):
        if _STATE.get("installed") is not None and _bound(module) is _STATE["installed"]:
            setattr(module, "get_forward_backward_func", _STATE["original"])
    _STATE.pop("installed", None)
    record_installed(None)


def install_when_imported() -> None:
    """Under ``ds-chimera launch --pipeline-schedule``: install once Megatron's schedules are imported."""
    if not os.environ.get(ENV_SCHEDULE):
        return
    from .._import_hooks import call_after_import
    call_after_import("megatron.core.pipeline_parallel", lambda module: install())
