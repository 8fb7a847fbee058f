"""ds_chimera: pipeline schedules for DeepSpeed, Megatron-Core and the HF Trainer.

Importing the package makes ``deepspeed.initialize`` honour ``"pipeline": {"schedule": ...}``
(without importing DeepSpeed eagerly: the CLI and simulator stay light).
"""
__version__ = "0.1.0"

from .integrations.deepspeed import initialize, install_when_imported

install_when_imported()
from .hf.hook import install as _install_hf_hooks  # noqa: E402
_install_hf_hooks()      # an HF Trainer whose DeepSpeed config has "pipeline" trains pipelined


def _megatron_launch() -> None:
    """``ds-chimera launch --pipeline-schedule NAME``: route Megatron's schedule once it is imported."""
    import os
    if os.environ.get("DS_CHIMERA_PIPELINE_SCHEDULE"):
        from .megatron.install import install_when_imported as megatron_install_when_imported
        megatron_install_when_imported()


_megatron_launch()

__all__ = ["initialize", "__version__"]
