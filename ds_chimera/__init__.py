"""ds_chimera: pipeline schedules for DeepSpeed, Megatron-Core and the HF Trainer.

Importing the package makes ``deepspeed.initialize`` honour ``"pipeline": {"schedule": ...}``
(without importing DeepSpeed eagerly: the CLI and simulator stay light).
"""
__version__ = "0.1.0"

from .integrations.deepspeed import initialize, install_when_imported

install_when_imported()

__all__ = ["initialize", "__version__"]
