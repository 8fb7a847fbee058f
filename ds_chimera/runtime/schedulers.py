"""An LR-scheduler instance the script built on its optimizer, moved onto the optimizer ds_chimera rebuilt.

ds_chimera rebuilds the optimizer over the schedule's chunks (:mod:`.param_groups`), so a scheduler
instance the script passes to ``deepspeed.initialize`` (torch's ``LRScheduler``s, DeepSpeed's own
schedules, Megatron's ``OptimizerParamScheduler``) would otherwise set learning rates on an optimizer
nothing steps. Such objects reach their optimizer through an attribute (``.optimizer``, sometimes a
nested scheduler's: ``SequentialLR``, ``ChainedScheduler``); that reference is re-pointed, and the
scheduler object itself is kept, so its state (step count, last LR, warm-up position) is intact and the
LR trajectory is the stock engine's step for step.

Per-group lists (``base_lrs``, ``_last_lr``, ``lr_lambdas``...) follow the groups: a group left empty on
this rank is not in the rebuilt optimizer (see ``remap_groups``), so its entries are dropped too. What
cannot be re-pointed (the optimizer reached some other way, a per-group list this module does not know
while groups were dropped) is refused, naming the class.
"""
from __future__ import annotations

import weakref
from functools import wraps

# per-group lists of torch's and DeepSpeed's schedulers (entry i belongs to param_groups[i])
PER_GROUP_LISTS = frozenset({"base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "delta_lrs", "org_lrs",
                             "base_momentums", "max_momentums"})
NESTED_SCHEDULERS = ("_schedulers", "schedulers")


def repoint_scheduler(scheduler, old, new, kept: list) -> None:
    """Make ``scheduler`` drive ``new`` where it drove ``old``.

    ``kept``: for each of ``new``'s parameter groups, the index of ``old``'s group it was rebuilt from
    (in order; groups empty on this rank are missing). Raises ValueError naming the scheduler's class
    where it cannot be done."""
    found = _repoint(scheduler, old, new, kept, seen=set())
    if found:
        _track_step_called(old, new)
        return
    if _mentions(scheduler, old):
        raise ValueError(_cannot(scheduler, "it reaches the optimizer other than through an attribute"))
    # holds no reference to the optimizer: it does not drive it (a no-op or a callback); nothing to move


def _repoint(obj, old, new, kept: list, seen: set) -> bool:
    """Re-point ``obj``'s attributes (and its nested schedulers') at ``new``; True if any held ``old``."""
    if id(obj) in seen or not hasattr(obj, "__dict__"):
        return False
    seen.add(id(obj))
    attrs = vars(obj)
    found = False
    for name, value in list(attrs.items()):
        if value is old:
            setattr(obj, name, new)
            found = True
    for name in NESTED_SCHEDULERS:
        for inner in attrs.get(name) or ():
            found = _repoint(inner, old, new, kept, seen) or found
    if found and len(kept) != len(old.param_groups):
        _drop_missing_groups(obj, old, kept)
    return found


def _drop_missing_groups(obj, old, kept: list) -> None:
    count = len(old.param_groups)
    for name, value in list(vars(obj).items()):
        if not isinstance(value, (list, tuple)) or len(value) != count:
            continue
        if name not in PER_GROUP_LISTS:
            raise ValueError(_cannot(obj, f"its list {name!r} has one entry per parameter group, and groups "
                                          f"{sorted(set(range(count)) - set(kept))} are empty on this rank under "
                                          f"the schedule, so they are not in the rebuilt optimizer"))
        setattr(obj, name, type(value)(value[i] for i in kept))


def _mentions(scheduler, old) -> bool:
    """Whether ``old`` is reachable from the scheduler's attributes one container deep (lists, dicts, closures)."""
    for value in vars(scheduler).values() if hasattr(scheduler, "__dict__") else ():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if item is old or getattr(item, "__self__", None) is old:
                return True
            cells = getattr(item, "__closure__", None) or ()
            if any(_cell_value(cell) is old for cell in cells):
                return True
    return False


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:       # an empty cell
        return None


def _cannot(scheduler, why: str) -> str:
    return (f"ds_chimera rebuilt the optimizer on the schedule's chunks and cannot move the LR scheduler "
            f"{type(scheduler).__name__} onto it: {why}; pass lr_scheduler as a callable (lambda optimizer: ...) or "
            f"configure a \"scheduler\" in the DeepSpeed config")


def _track_step_called(old, new) -> None:
    """torch's LRScheduler wraps its optimizer's ``step`` to note that it ran (it warns when the scheduler
    steps first); the rebuilt optimizer gets the same wrapper, with the note carried over."""
    if not hasattr(getattr(old, "step", None), "_wrapped_by_lr_sched") or \
            hasattr(new.step, "_wrapped_by_lr_sched"):
        return
    new._opt_called = getattr(old, "_opt_called", False)
    ref = weakref.ref(new)
    func = new.step.__func__

    @wraps(func)
    def step(*args, **kwargs):
        optimizer = ref()
        optimizer._opt_called = True
        return func.__get__(optimizer, type(optimizer))(*args, **kwargs)
    step._wrapped_by_lr_sched = True
    new.step = step
