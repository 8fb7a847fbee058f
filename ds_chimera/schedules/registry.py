"""Find schedules by name: the package's own and any registered by other packages.

The package's own are listed once, in :func:`_builtin`. Another package registers one
through the ``ds_chimera.schedules`` entry-point group, in its setup:
``entry_points={"ds_chimera.schedules": ["mine = mypkg.sched:MySchedule"]}``.
"""
from __future__ import annotations

import functools
import sys
from importlib import metadata

from ..logs import get_logger
from .base import AsynchronousSchedule, Schedule

ENTRY_POINT_GROUP = "ds_chimera.schedules"
log = get_logger()


def _builtin() -> dict:
    from .asynchronous import PipeDream, PipeDream2BW, PipeOptim, SpecTrain
    from .chimera import Chimera
    from .classic import GPipe, OneFOneB
    from .dualpipev import DualPipeV
    from .looped import BreadthFirst, Interleaved
    from .zero_bubble import ZBH1, ZBV
    return {cls.name: cls for cls in (GPipe, OneFOneB, Interleaved, BreadthFirst, Chimera, ZBH1, ZBV,
                                      DualPipeV, PipeDream, PipeDream2BW, PipeOptim, SpecTrain)}


_extra: dict = {}


def register(cls: type) -> type:
    """Register a Schedule subclass in this process (a decorator; entry points are preferred)."""
    problem = _not_a_schedule(cls) or ("has no name" if not cls.name else "")
    if problem:
        raise ValueError(f"register() needs a Schedule subclass with a name: {cls!r} {problem}")
    _extra[cls.name] = cls
    return cls


def _not_a_schedule(cls) -> str:
    """Why ``cls`` cannot be registered ("" if it can): the engines rely on the contracts' methods."""
    if not (isinstance(cls, type) and issubclass(cls, Schedule)):
        return "is not a ds_chimera Schedule subclass"
    if not cls.synchronous and not issubclass(cls, AsynchronousSchedule):
        return ("sets synchronous = False but does not subclass ds_chimera.schedules.base.AsynchronousSchedule, "
                "which states what the asynchronous engine calls")
    return ""


def available() -> dict:
    """name -> Schedule class: built-ins, entry-point plugins, then in-process registrations."""
    found = {**_builtin(), **_plugins(tuple(sys.path))}
    found.update(_extra)
    return found


@functools.lru_cache(maxsize=4)
def _plugins(search_path: tuple) -> dict:
    """The entry-point schedules importable from ``search_path``: scanned once per path (reading every
    installed package's metadata costs milliseconds, and every config parse asks)."""
    found = _builtin()
    plugins = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and ep.value.startswith("ds_chimera."):
            continue
        try:
            cls = ep.load()
        except Exception as exc:   # a broken plugin must not take the built-ins down
            log.warning("schedule plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        problem = _not_a_schedule(cls)
        if problem:
            log.warning("schedule plugin %r (%s) %s", ep.name, ep.value, problem)
            continue
        plugins[ep.name] = cls
    return plugins


def get(name: str, synchronous_only: bool = False) -> type:
    """The class of schedule ``name``. ``synchronous_only``: the caller runs only synchronous schedules (its
    error for an unknown name lists only those)."""
    schedules = available()
    if name not in schedules:
        listed = sorted(n for n, cls in schedules.items() if cls.synchronous or not synchronous_only)
        raise ValueError(f"unknown schedule {name!r}.{_near_match(name, listed)} Available: {', '.join(listed)}")
    return schedules[name]


def _near_match(name, names: list) -> str:
    """" Did you mean 'chimera'?" for a typo (stray spaces, case, a letter off), else ""."""
    import difflib
    typed = str(name).strip().lower().replace("_", "-")
    if typed in names:
        return f" Did you mean {typed!r}?"
    near = difflib.get_close_matches(typed, names, n=1, cutoff=0.6)
    return f" Did you mean {near[0]!r}?" if near else ""


def checked(name: str, options: dict, caller_steps: bool = False) -> type:
    """The class of schedule ``name`` once ``options`` are known to be its own; before any work.

    ``caller_steps``: the caller runs the optimizer step after the schedule (Megatron's
    forward-backward contract), so an asynchronous schedule, which steps inside, is refused.
    """
    cls = get(name, synchronous_only=caller_steps)
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ValueError(f"schedule {name!r} has no option {unknown[0]!r}; allowed: "
                         f"{', '.join(sorted(cls.options)) or 'none'}")
    if caller_steps and not cls.synchronous:
        raise ValueError(f"schedule {name!r} is asynchronous (it steps each stage inside the pipeline); "
                         f"Megatron's forward-backward contract leaves the optimizer step to the caller, so use "
                         f"a synchronous schedule: {synchronous_names()}")
    return cls


def synchronous_names() -> str:
    """The synchronous schedules' names, for the messages that refuse an asynchronous one."""
    return ", ".join(sorted(n for n, cls in available().items() if cls.synchronous))


def build(name: str, stages: int, micro_batches: int, **options) -> Schedule:
    """Construct the named schedule; bad names and options raise ValueError before any work."""
    return get(name)(stages, micro_batches, **options)
