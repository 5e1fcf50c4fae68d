"""The attention function registered in transformers' AttentionInterface under the name "kitty".

transformers calls `cache.update(...)` and then the attention function; a KittyLayer tags the key tensor it
returns, and this function hands the step to that layer. Any other cache (or none) gets plain SDPA, so a model
switched to "kitty" behaves exactly as with "sdpa" for DynamicCache and friends.
"""
from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "kitty"


def kitty_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = getattr(key, "kitty_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(module, query, key, value, attention_mask, scaling, **kwargs), None


def use_kitty_attention(model) -> None:
    """Register the attention function (and SDPA's mask format for it) and switch `model` to it."""
    AttentionInterface.register(NAME, kitty_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
