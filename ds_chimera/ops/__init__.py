"""LightConv and DynamicConv ops (Wu et al., ICLR 2019) registered as ``torch.ops.ds_chimera.*``."""
from .library import dynamicconv, lightconv

__all__ = ["dynamicconv", "lightconv"]
