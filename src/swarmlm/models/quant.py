"""Weight-only quantization of a span's blocks: int8 (one float scale per output row, implemented here) or nf4
(4-bit NormalFloat in blocks of 64 weights with one float scale each, packed and unpacked by bitsandbytes). Each
Linear keeps its quantized weight and dequantizes it for each call, so memory per block drops ~4x (int8) or ~7x (nf4)
from fp32 and autograd wrt inputs still works (backward requests are served as usual)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from swarmlm.errors import SwarmError
from swarmlm.models.constants import QUANT_MODES

# the largest magnitude of a signed 8-bit value: each row's largest |weight| maps to it
_INT8_MAX = 127.0
# weights per nf4 scale: bitsandbytes' default (QLoRA's choice); 4.5 bits per weight with a float32 scale
NF4_BLOCKSIZE = 64


class Int8Linear(nn.Module):
    """A frozen Linear whose weight is stored as int8 rows times a float32 scale per row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / _INT8_MAX  # (out, 1)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int8: torch.Tensor
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight_int8", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)  # (out, in), for this call only
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@functools.cache
def bnb_functional() -> ModuleType:
    """bitsandbytes.functional, or a SwarmError saying how to install it (it is needed only for nf4)."""
    # its import notice about an optional kernel is filtered out by swarmlm/__init__.py
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError as e:
        raise SwarmError("--quant nf4 needs bitsandbytes: pip install 'swarmlm[nf4]'") from e
    return bnb_f


# the OpenMP thread count torch last set in each thread (see _match_torch_threads)
_openmp_threads = threading.local()


def _match_torch_threads() -> None:
    """bitsandbytes' CPU loops run on as many OpenMP threads as the calling thread's OpenMP setting, which torch sets
    only in the thread that called torch.set_num_threads; a server computes in a worker thread, where the default
    (every core) would oversubscribe the CPU past --num-threads. Apply torch's count to this thread, once."""
    threads = torch.get_num_threads()
    if getattr(_openmp_threads, "count", None) != threads:
        torch.set_num_threads(threads)
        _openmp_threads.count = threads


class Nf4Linear(nn.Module):
    """A frozen Linear whose weight is stored as packed 4-bit NormalFloat codes (two per byte) times a float32 scale
    per block of NF4_BLOCKSIZE weights. Forward dequantizes to the input's dtype and runs a plain F.linear, so
    autograd wrt the input works (bitsandbytes' own Linear4bit repacks its weight on CPU at the first call without
    gradients, after which it silently returns no input gradient)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        bnb_f = bnb_functional()
        weight = linear.weight.detach().contiguous()  # (out, in)
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            weight = weight.float()
        _match_torch_threads()  # servers load their blocks in a worker thread too
        packed, state = bnb_f.quantize_4bit(weight, blocksize=NF4_BLOCKSIZE, quant_type="nf4")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_nf4: torch.Tensor
        self.absmax: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight_nf4", packed)  # (out * in / 2, 1) uint8: two codes per byte
        self.register_buffer("absmax", state.absmax.float())  # (out * in / NF4_BLOCKSIZE,) float32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a new (out, in) float tensor of `dtype`."""
        shape = torch.Size((self.out_features, self.in_features))
        bnb_f = bnb_functional()
        _match_torch_threads()
        state = bnb_f.QuantState(self.absmax, shape, blocksize=NF4_BLOCKSIZE, quant_type="nf4", dtype=dtype)
        return bnb_f.dequantize_4bit(self.weight_nf4, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dequantized(x.dtype)  # for this call only
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


def _replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, make(child))
            replaced += 1
        else:
            replaced += _replace_linears(child, make)
    return replaced


def quantize_int8(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by an Int8Linear, in place; returns how many were replaced. Weights
    that are no Linear (norms, Mixtral's stacked experts) stay as they are."""
    return _replace_linears(module, Int8Linear)


def quantize_nf4(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by an Nf4Linear, in place; returns how many were replaced. Weights
    that are no Linear (norms, Mixtral's stacked experts) stay as they are."""
    bnb_functional()  # a missing bitsandbytes fails here, before any layer is touched
    return _replace_linears(module, Nf4Linear)


def quantize(module: nn.Module, mode: str) -> int:
    """Quantize `module`'s Linears in place to `mode` (one of QUANT_MODES); returns how many were replaced."""
    if mode == "int8":
        return quantize_int8(module)
    if mode == "nf4":
        return quantize_nf4(module)
    raise SwarmError(f"quantization must be one of {', '.join(QUANT_MODES)}, not {mode!r}")


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers: its resident weights."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
