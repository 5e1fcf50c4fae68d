"""Decode steps of a KittyCache replayed as one CUDA graph each: the GPU no longer waits for Python.

An eager decode step of a 36-layer model launches ~2,500 kernels from Python; on the H200 issuing them takes
~45 ms while the GPU needs ~13 ms (`python -m backend.step_profile`, BENCHMARKS.md). Capturing the step once
and replaying it launches the same work in one call.

    with CudaGraphDecoding(model):
        model.generate(ids, past_key_values=make_cache(model, "kitty-pro", reserve_tokens=...), ...)

Decode steps (one new token per sequence) are replayed; prefill and prompt chunks run eagerly, as do caches
with a 16-bit side. The graph holds the ordinary step's work: insert the token, attend. A page-boundary step
replays it too and then quantizes the full buffers eagerly, layer by layer: that reads and writes only each
layer's own storage, so doing it after the forward instead of inside it changes nothing
(`KittyLayer.next_decode_is_ordinary` tells the steps apart on the host). A step is captured when it is ordinary
and follows an eager step with the same storage (kernels compiled, workspaces allocated), and captured again
whenever a tensor the step touches moves (a page table or pool that grew, a beam reorder):
`KittyLayer.storage_pointers`; `reserve_tokens` sizes them all up front, so a reserved run captures once.

The attention mask is not passed to a decode step here: the decode path reads each sequence's length from the
cache, and building the mask would synchronize with the GPU; positions are passed as tensors, as the model would
compute them. Not thread-safe: one generation at a time per model while it is active.
"""
from __future__ import annotations

import functools
import inspect

import torch

from .cache import KittyCache, KittyLayer


class CudaGraphDecoding:
    """Context manager: `model`'s forward replays captured decode steps for KittyCaches on CUDA (see above).
    `replays` and `captures` count what happened; `disabled` says why graphs were given up, if they were."""

    def __init__(self, model):
        self.model = model
        self.eager = model.forward
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key = None                 # what the captured step was captured for
        self.warm = None                # the key after the last eager decode step
        self.static: dict[str, torch.Tensor] = {}
        self.output = None
        self.replays = self.captures = 0
        self.disabled: str | None = None
        accepted = inspect.signature(self.eager).parameters
        self.position_inputs = [name for name in ("position_ids", "cache_position") if name in accepted]

    def __enter__(self):
        self._had_own_forward = "forward" in self.model.__dict__

        @functools.wraps(self.eager)
        def forward(*args, **kwargs):
            return self(*args, **kwargs)
        self.model.forward = forward
        return self

    def __exit__(self, *exc):
        if self._had_own_forward:
            self.model.forward = self.eager
        else:
            del self.model.forward
        self.graph = self.output = None
        self.static = {}

    def __call__(self, input_ids=None, past_key_values=None, **kwargs):
        layers = self._decode_layers(input_ids, past_key_values, kwargs)
        if layers is None:
            return self.eager(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
        kwargs.pop("attention_mask", None)
        tensors = {"input_ids": input_ids, **{k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}}
        # positions the model would compute from the cache's length (a host number, frozen into a capture): given
        # as tensors, they are inputs that each replay refreshes
        position = torch.arange(1, device=input_ids.device) + past_key_values.get_seq_length()
        for name in self.position_inputs:
            tensors.setdefault(name, position if name == "cache_position" else position.unsqueeze(0))
        options = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        key = (tuple(p for layer in layers for p in layer.storage_pointers()),
               tuple((k, tuple(v.shape), v.dtype) for k, v in tensors.items()), repr(sorted(options.items())))
        # every layer holds the same lengths and page counts: the first one decides for all
        ordinary = layers[0].next_decode_is_ordinary()
        if self.graph is not None and key == self.key:
            for name, value in tensors.items():
                self.static[name].copy_(value)
            self.graph.replay()
            for layer in layers:                # a page-boundary step quantizes after the replayed forward
                layer.replayed_decode_step(ordinary)
            self.replays += 1
            return self.output
        if not ordinary or key != self.warm:    # captured: an ordinary step after an eager one with this storage
            # (kernels compiled, workspaces allocated); a page-boundary step's quantization is never captured
            out = self.eager(past_key_values=past_key_values, **tensors, **options)
            self.warm = (tuple(p for layer in layers for p in layer.storage_pointers()), *key[1:])
            return out
        return self._capture(key, layers, past_key_values, tensors, options)

    def _decode_layers(self, input_ids, cache, kwargs) -> list[KittyLayer] | None:
        """The cache's layers when this call is a decode step that a graph can replay, else None."""
        if (self.disabled or input_ids is None or input_ids.shape[-1] != 1 or not input_ids.is_cuda
                or kwargs.get("inputs_embeds") is not None or not isinstance(cache, KittyCache)):
            return None
        layers = cache.layers
        if not all(isinstance(layer, KittyLayer) and layer.graphable() for layer in layers):
            return None
        return layers

    def _capture(self, key, layers, cache, tensors, options):
        """Capture this step (its host-side effects happen while capturing), then run it by one replay."""
        self.graph = self.output = None                         # the previous graph's memory goes back first
        static = {name: value.clone() for name, value in tensors.items()}
        saved = [(layer.seen, layer.lengths.copy()) for layer in layers]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = self.eager(past_key_values=cache, **static, **options)
        except Exception as exc:                                # e.g. a host sync inside the model: stay eager
            for layer, (seen, lengths) in zip(layers, saved):   # the captured step's GPU work never ran
                layer.seen, layer.lengths = seen, lengths
            self.disabled = f"capture failed: {type(exc).__name__}: {exc}"
            return self.eager(past_key_values=cache, **tensors, **options)
        graph.replay()
        self.graph, self.key, self.static, self.output = graph, key, static, output
        self.captures += 1
        return output
