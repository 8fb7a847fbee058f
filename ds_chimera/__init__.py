"""ds_chimera: pipeline schedules for DeepSpeed, Megatron-Core and the HF Trainer."""
__version__ = "0.1.0"
