"""Entry points from DeepSpeed, Megatron-Core and the Hugging Face Trainer."""
