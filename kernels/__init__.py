"""Triton kernels of the Kitty cache, each module holding kernels, launch wrappers and the PyTorch references
they must equal: layout (page format, bit accounting), quantize, dequantize, decode_attention."""
import os

import torch

# Without a GPU, Triton kernels can only run under Triton's interpreter (on CPU tensors). Turn it on before any
# kernel is defined, so `use_triton=True`, the kernel tests and `bench --quick` work on any machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
