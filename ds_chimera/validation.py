"""Checks of user-supplied values, shared by every entry point (config, CLI, Megatron, Wavelet).

A leaf module (standard library only), so that schedules, the runtime and the
integrations all raise the same message for the same mistake: the bad value, what is
allowed, and where it came from.
"""
from __future__ import annotations

import difflib
import math


def check_int(where: str, name: str, value, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``; else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


def check_choice(where: str, name: str, value, allowed):
    """``value`` if it is one of ``allowed``; else a ValueError listing them."""
    if value not in allowed:
        raise ValueError(f"{where}: {name} must be one of {', '.join(map(str, allowed))}; got {value!r}")
    return value


def check_seconds(where: str, name: str, value) -> float:
    """A finite duration > 0 (a timeout): NaN and infinity would turn every wait into a hang."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_fraction(where: str, name: str, value, low: float = 0.0, high: float = 1.0) -> float:
    """A number in [low, high)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise ValueError(f"{where}: {name} must be a number in [{low:g}, {high:g}), got {value!r}")
    return float(value)


def check_mapping(where: str, name: str, value, allowed_keys, example: str) -> dict:
    """A mapping whose keys are all in ``allowed_keys`` (values are checked by the caller)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {name} must be a mapping such as {example}, got {value!r}")
    for key in value:
        if key not in allowed_keys:
            raise unknown_key_error(f"{where}: {name}", key, allowed_keys)
    return dict(value)


def unknown_key_error(where: str, key: str, allowed) -> ValueError:
    """The error for a key nobody reads: names it, suggests the nearest allowed key, lists them all."""
    allowed = sorted(allowed)
    lowered = {a.lower(): a for a in allowed}
    near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6) or \
        ([lowered[key.lower()]] if key.lower() in lowered else []) or \
        [lowered[m] for m in difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)]
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return ValueError(f"{where}: unknown key {key!r}.{hint} Allowed: {', '.join(allowed) or 'none'}")
