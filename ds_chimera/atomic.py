"""Atomic file writes: a reader (or a resumed run) never sees half a file.

Every file ds_chimera writes goes through a temporary file in the same directory and
one ``os.replace``, which POSIX makes atomic. A crash leaves at most a stray ``.tmp``
file, never a truncated checkpoint, trace or program. A leaf module (no torch import
until :func:`torch_save_atomic` is called).
"""
from __future__ import annotations

import json
import os


def _tmp(path) -> str:
    return f"{os.fspath(path)}.tmp.{os.getpid()}"


def write_text_atomic(path, text: str) -> None:
    tmp = _tmp(path)
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(path, obj) -> None:
    write_text_atomic(path, json.dumps(obj))


def torch_save_atomic(obj, path) -> None:
    import torch
    tmp = _tmp(path)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
