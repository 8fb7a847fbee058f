"""Loaded by every Python process started under ``ds-chimera launch``: enable the schedule switch.

``import ds_chimera`` only installs an import hook (DeepSpeed itself is not imported here),
then any other ``sitecustomize`` further down ``sys.path`` runs as it would have.
"""
import importlib.machinery
import importlib.util
import os
import sys

try:
    import ds_chimera  # noqa: F401
except Exception as exc:  # never break interpreter start-up
    print(f"ds_chimera: could not enable the schedule switch: {exc}", file=sys.stderr)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None and os.path.dirname(os.path.abspath(_spec.origin)) != _here:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
