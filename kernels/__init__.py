"""Triton kernels of the Kitty cache, each beside the PyTorch reference it must equal."""
from . import quantize
from .decode_attention import decode_attention, decode_attention_ref, gather_kv
from .dequantize import dequantize_keys, dequantize_keys_ref, dequantize_values, dequantize_values_ref
from .layout import NO_BOOST, PagedKV

__all__ = ["quantize", "decode_attention", "decode_attention_ref", "gather_kv", "dequantize_keys",
           "dequantize_keys_ref", "dequantize_values", "dequantize_values_ref", "NO_BOOST", "PagedKV"]
