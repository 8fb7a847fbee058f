"""Wavelet: tick-tock data-parallel training (two offset waves of tasks per device).

Enabled by ``"wavelet": {"enabled": true}`` in the DeepSpeed config (after ``import
ds_chimera``) or by ``ds-chimera launch --wavelet``. See :mod:`ds_chimera.wavelet.engine`
for the exact synchronisation semantics and :mod:`ds_chimera.sim.memory` for the memory model.
"""
from .layout import TICK, TOCK, WaveLayout
from .reference import wavelet_reference

__all__ = ["TICK", "TOCK", "WaveLayout", "wavelet_reference"]
