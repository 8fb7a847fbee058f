"""Which schedule a Megatron launch runs: ``install()``'s choice, the command line, or the launcher's environment.

``--pipeline-schedule NAME`` and ``--pipeline-schedule-options JSON`` are taken out of
``sys.argv`` (Megatron's own parser never sees them); ``ds-chimera launch --pipeline-schedule
NAME`` sets ``DS_CHIMERA_PIPELINE_SCHEDULE`` and ``DS_CHIMERA_PIPELINE_OPTIONS``. The routing
(:mod:`.install`) records what it installed here, so that building the chunks
(:mod:`.stages`) follows it without depending on the routing.
"""
from __future__ import annotations

import json
import os
import sys

from ..config import PipelineConfig

ENV_SCHEDULE = "DS_CHIMERA_PIPELINE_SCHEDULE"
ENV_OPTIONS = "DS_CHIMERA_PIPELINE_OPTIONS"
_INSTALLED: dict = {}          # "choice": the PipelineConfig while install()'s routing is in place


def _take_flag(argv: list, flag: str):
    """Remove ``flag VALUE`` or ``flag=VALUE`` from argv; return VALUE or None."""
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(flag + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def _parse_options(text):
    if text in (None, ""):
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"pipeline schedule options must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError(f"pipeline schedule options must be a JSON object, got {text!r}")
    return options


def chosen_schedule(argv: list | None = None) -> tuple:
    """(name, options) from argv (consumed) or the environment; (None, {}) when none is chosen."""
    argv = sys.argv if argv is None else argv
    name = _take_flag(argv, "--pipeline-schedule")
    options = _take_flag(argv, "--pipeline-schedule-options")
    if name is None:
        name = os.environ.get(ENV_SCHEDULE) or None
    if options is None:
        options = os.environ.get(ENV_OPTIONS)
    return name, _parse_options(options)


def virtual_pipeline_size(vp_size=None):
    """``vp_size`` if given, else Megatron's virtual-pipeline size (None when Megatron is not initialised)."""
    if vp_size is not None:
        return vp_size
    try:
        from megatron.core import parallel_state
        return parallel_state.get_virtual_pipeline_model_parallel_world_size()
    except Exception:      # Megatron not initialised: no virtual stages
        return None


def record_installed(config: PipelineConfig | None) -> None:
    """What ``install()`` routed Megatron to; None when ``uninstall()`` gave Megatron its own back."""
    if config is None:
        _INSTALLED.pop("choice", None)
    else:
        _INSTALLED["choice"] = config


def installed_choice() -> PipelineConfig | None:
    """The installed routing's configuration (install(), --pipeline-schedule), or None."""
    if "choice" in _INSTALLED:
        return _INSTALLED["choice"]
    name = os.environ.get(ENV_SCHEDULE) or None
    if name is None:
        return None
    return PipelineConfig.from_megatron(name, _parse_options(os.environ.get(ENV_OPTIONS)), where=ENV_OPTIONS)
