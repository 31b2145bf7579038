"""Weight-only int8 quantization of a span's blocks: each Linear keeps int8 weights with one float scale per output
row and dequantizes them for each call, so memory per block drops ~4x from fp32 and autograd wrt inputs still works
(backward requests are served as usual)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn

# the largest magnitude of a signed 8-bit value: each row's largest |weight| maps to it
_INT8_MAX = 127.0
QUANT_MODES = ("int8",)


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


def quantize_int8(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by an Int8Linear, in place; returns how many were replaced. Weights
    that are no Linear (norms, Mixtral's stacked experts) stay as they are."""
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, Int8Linear(child))
            replaced += 1
        else:
            replaced += quantize_int8(child)
    return replaced


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers: its resident weights."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
