"""Layers and models built on the ds_chimera convolution ops."""
from .blocks import ConvBlock, ConvLayer
from .conv import DynamicConv1dTBC, LightweightConv1dTBC
from .lm import ConvLM, LMHead, TokenEmbedding, counting_batches, lm_layer_specs, lm_loss

__all__ = ["ConvBlock", "ConvLayer", "ConvLM", "DynamicConv1dTBC", "LMHead", "LightweightConv1dTBC",
           "TokenEmbedding", "counting_batches", "lm_layer_specs", "lm_loss"]
