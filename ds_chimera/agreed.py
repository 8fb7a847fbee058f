"""Errors every rank raises together, having agreed on them (a broadcast result, a shared check).

Fault containment (``runtime.faults``) spreads one rank's failure to the others; an error every
rank already raises has nowhere to spread, and publishing it would name as its origin whichever
rank happened to report first. A leaf module (nothing from ds_chimera), so that the planner,
which must not import the runtime, marks its agreed errors and the runtime's guard reads the mark.
"""
from __future__ import annotations

_MARK = "ds_chimera_raised_on_every_rank"


def on_every_rank(exc: BaseException) -> BaseException:
    """``exc``, marked as raised by every rank at once (the caller raises it)."""
    setattr(exc, _MARK, True)
    return exc


def raised_on_every_rank(exc: BaseException) -> bool:
    """Whether ``exc`` was marked by :func:`on_every_rank`."""
    return bool(getattr(exc, _MARK, False))
