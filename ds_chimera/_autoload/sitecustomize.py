"""Loaded by every Python process started under ``ds-chimera launch``: enable the schedule switch.

``import ds_chimera`` only installs an import hook (DeepSpeed itself is not imported here),
then any other ``sitecustomize`` further down ``sys.path`` runs as it would have.
"""
import importlib.machinery
import importlib.util
import os
import sys

# ds-chimera launch --wavelet: two tasks per device, so local ranks 0..2N-1 map onto N devices.
# Only where there are GPUs: on CPU there is no device to share, and DeepSpeed's CPU shared-memory
# collectives key on LOCAL_RANK (DeepSpeed falls back to CPU on its own when no GPU is present).
_gpus = os.environ.get("DS_ACCELERATOR", "cuda") != "cpu" and os.path.exists("/dev/nvidiactl")
if os.environ.get("DS_CHIMERA_WAVELET") == "1" and os.environ.get("DS_CHIMERA_DEVICES_PER_NODE", "").isdigit() \
        and _gpus:
    if os.environ.get("LOCAL_RANK", "").isdigit():
        os.environ["LOCAL_RANK"] = str(int(os.environ["LOCAL_RANK"]) % int(os.environ["DS_CHIMERA_DEVICES_PER_NODE"]))

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
