"""A request's own LoRA weights applied to a block for one call: forward hooks on its adapted Linear modules that add
scaling * B(A(x)) to their outputs, removed when the call ends (other requests run on the same block in between)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from swarmlm.protocol.lora import LoraWeights


def linear_shapes(block: nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of the block's Linear-like modules (nn.Linear, int8 Linear, a Linear
    wrapped by a served PEFT adapter), outermost only: what a LoRA target may name."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in block.named_modules():
        if not name or any(name.startswith(outer + ".") for outer in shapes):
            continue
        fan_in, fan_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(fan_in, int) and isinstance(fan_out, int):
            shapes[name] = (fan_in, fan_out)
    return shapes


def _add_lora(
    module: nn.Module, args: tuple, output: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The hook: output + B(A(x)) * scaling, in the order PEFT's LoRA Linear computes it."""
    x = args[0].to(a.dtype)
    return output + (F.linear(F.linear(x, a), b) * scaling).to(output.dtype)


@contextlib.contextmanager
def lora_applied(block: nn.Module, lora: LoraWeights | None, index: int) -> Iterator[None]:
    """While inside, calls of `block` (global index `index`) add the LoRA of that block in `lora`; the hooks are
    removed on leaving, also on error."""
    if lora is None:
        yield
        return
    handles = []
    try:
        for name, a, b in lora.layout.matrices(lora.flat, index - lora.first):
            hook = functools.partial(_add_lora, a=a, b=b, scaling=lora.spec.scaling)
            handles.append(block.get_submodule(name).register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
