"""The 8-bit wire form of a float tensor: int8 values plus one float32 absmax scale per row of its last dimension.

A row x travels as q = round(x / s) with s = max|x| / 127 (1 for an all-zero row), and is read back as q * s: each
value moves by at most s / 2, half a step of its own row's scale (per token for hidden states, so one large token
does not flatten the others). Receivers check the scales before using them (shape, finite, positive, bounded).
"""

from __future__ import annotations

import torch

from swarmlm.errors import ProtocolError

# the largest int8 magnitude used (symmetric: -128 is never produced)
QMAX = 127
# a scale above this would dequantize +-127 to infinity in float32
MAX_SCALE = torch.finfo(torch.float32).max / QMAX


def compressible(tensor_dim: int) -> bool:
    """Whether a tensor of this many dimensions may travel in a lossy form (int8 here, 16-bit in client/wire.py):
    activations and prompts, which have rows, do; 1-D ones (a LoRA's flat weights and their gradients: parameters,
    which one scale for all would corrupt) do not."""
    return tensor_dim >= 2


def quantizable(tensor: torch.Tensor) -> bool:
    """Whether a tensor travels in 8-bit form in an int8 message: compressible float tensors."""
    return tensor.is_floating_point() and compressible(tensor.dim())


def quantize_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values shaped like tensor, float32 scales shaped like tensor.shape[:-1])."""
    values = tensor.detach().to("cpu", torch.float32)
    if values.shape[-1] == 0:
        return values.to(torch.int8), torch.ones(values.shape[:-1])
    absmax = values.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    quantized = torch.round(values / scales.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return quantized, scales


def dequantize_rows(quantized: torch.Tensor, scales: torch.Tensor, index: int) -> torch.Tensor:
    """The float32 tensor an 8-bit tensor stands for; ProtocolError if its scales do not fit it."""
    if quantized.dtype != torch.int8 or quantized.dim() < 1:
        raise ProtocolError(f"tensor {index}: 8-bit values must be an int8 tensor of at least one dimension")
    if scales.dtype != torch.float32 or scales.shape != quantized.shape[:-1]:
        raise ProtocolError(
            f"tensor {index}: {quantized.shape[:-1].numel()} float32 scales of shape {tuple(quantized.shape[:-1])} "
            f"expected, got {scales.dtype} of shape {tuple(scales.shape)}"
        )
    if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()) or bool((scales > MAX_SCALE).any()):
        raise ProtocolError(f"tensor {index}: scales must be finite, positive and at most {MAX_SCALE:.3g}")
    return quantized.to(torch.float32) * scales.unsqueeze(-1)
