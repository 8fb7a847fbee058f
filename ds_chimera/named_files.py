"""One rule for every file a configuration names (``plan_file``, ``profile_file``, ``program``) or a checkpoint
holds (its layout file, layer and state files): a missing, unreadable, malformed or mismatched file raises a
ValueError that names the key (or checkpoint), the path, what was wrong in it and what to do, never a bare
``JSONDecodeError`` or ``TypeError`` from deep inside a reader."""
from __future__ import annotations

import json
import os
import pickle

# what a damaged or foreign file raises while being read and parsed
READ_ERRORS = (OSError, EOFError, UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, RuntimeError,
               pickle.UnpicklingError)


def read_named_file(what: str, path, parse, fix: str):
    """``parse(path)`` for the file ``what`` names (e.g. ``'"pipeline": plan_file'``); its failure as one ValueError
    saying what is wrong and ``fix``, what to do about it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist; {fix}")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a folder, not a file; {fix}")
    try:
        return parse(path)
    except READ_ERRORS as exc:
        raise ValueError(f"{what} {path!r} cannot be used: {describe(exc)}; {fix}") from None


def describe(exc: BaseException) -> str:
    """An exception as a user reads it: its kind and message, first line (the JSON error's has line and column)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_json(path: str):
    with open(path) as fh:
        return json.load(fh)
