"""LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) added to a span's blocks only, and
the choice of the adapter each computation runs with (none: the base model)."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from swarmlm.errors import ModelLoadError
from swarmlm.models.constants import ADAPTER_CONFIG

if TYPE_CHECKING:
    from peft import LoraConfig

    from swarmlm.models.span import SpanModel

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# an adapter is named by its folder; the name travels in records and requests, so it is kept short and plain
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# what PEFT prefixes the names of a causal LM's tensors with in a saved adapter
_PEFT_PREFIX = "base_model.model."
# the LoRA tensors of one adapted Linear, as PEFT saves them (without the adapter's name)
_LORA_TENSOR = re.compile(r"(.+)\.(lora_A|lora_B)\.weight")


def adapter_name(path: str | Path) -> str:
    """The name of the adapter in folder `path`: the folder's name, which must match ADAPTER_NAME."""
    name = Path(path).expanduser().resolve().name
    if not ADAPTER_NAME.fullmatch(name):
        raise ModelLoadError(f"adapter folder name {name!r} is not a valid adapter name (letters, digits, . _ -)")
    return name


def load_adapters(span: SpanModel, paths: Sequence[str | Path]) -> tuple[str, ...]:
    """Adds the LoRA adapters in `paths` to the span's blocks (frozen, inactive until chosen); returns their names."""
    names = [adapter_name(path) for path in paths]
    if len(set(names)) != len(names):
        raise ModelLoadError(f"two adapter folders have the same name: {names}")
    for path, name in zip(paths, names, strict=True):
        _add_adapter(span, Path(path).expanduser(), name)
    span.adapters = (*span.adapters, *names)
    span.eval().requires_grad_(False)  # injected modules start in training mode (dropout) and trainable
    # PEFT injects an adapter enabled and active, while the span still reads "no adapter": applied unconditionally,
    # or the first requests naming no adapter would run with the last one loaded
    _apply_adapter(span, None)
    return tuple(names)


def select_adapter(span: SpanModel, name: str | None) -> None:
    """Make `name` (None: no adapter) the one the span's LoRA layers apply, if it is not already."""
    if name == span.active_adapter:
        return
    if name is not None and name not in span.adapters:
        raise ValueError(f"adapter {name!r} is not loaded here (loaded: {list(span.adapters)})")
    _apply_adapter(span, name)


def _apply_adapter(span: SpanModel, name: str | None) -> None:
    """Set every LoRA layer of the span to apply `name` (None: none), whatever the span believes it applies now."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in span.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(name is not None)
            if name is not None:
                module.set_adapter(name, inference_mode=True)  # frozen: gradients go to inputs and prompts only
    span.active_adapter = name


def _add_adapter(span: SpanModel, folder: Path, name: str) -> None:
    from peft import inject_adapter_in_model

    config = _read_lora_config(folder)
    tensors = _read_weights(folder)
    blocks = _block_tensors(span, tensors, folder)
    # the blocks are injected one at a time, so the adapter's layer choice is applied here by global index
    wanted = config.layers_to_transform
    if isinstance(wanted, int):
        wanted = [wanted]
    per_block = dataclasses.replace(config, layers_to_transform=None, layers_pattern=None)
    for index, layer in zip(range(span.start, span.end), span.layers, strict=True):
        if wanted is not None and index not in wanted:
            continue
        try:
            with warnings.catch_warnings():
                # PEFT warns when a module gets a second adapter: several adapters per block are intended here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                inject_adapter_in_model(per_block, layer, adapter_name=name)
        except ValueError as e:  # e.g. target modules that block does not have
            raise ModelLoadError(f"cannot add adapter {folder} to block {index}: {e}") from e
        _load_block(layer, blocks.get(index, {}), name, folder, index)


def _read_lora_config(folder: Path) -> LoraConfig:
    from peft import LoraConfig

    try:
        raw = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {folder / ADAPTER_CONFIG}: {e}") from e
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise ModelLoadError(f"{folder} is not a LoRA adapter (peft_type {raw.get('peft_type')!r})")
    if raw.get("use_dora") or raw.get("modules_to_save") or raw.get("layer_replication"):
        raise ModelLoadError(f"{folder}: DoRA, modules_to_save and layer_replication are not supported")
    try:
        return LoraConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"cannot read the LoRA config in {folder}: {e}") from e


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(folder / ADAPTER_WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read {folder / ADAPTER_WEIGHTS}: {e}") from e


def _block_tensors(
    span: SpanModel, tensors: dict[str, torch.Tensor], folder: Path
) -> dict[int, dict[str, torch.Tensor]]:
    """The adapter's tensors by global block index, named within the block; tensors outside the blocks (an adapted
    LM head or embedding) are refused: the client computes those parts without adapters."""
    prefix = _PEFT_PREFIX + span.family.block_prefix
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            raise ModelLoadError(f"{folder}: tensor {name!r} adapts no decoder block; only blocks are served")
        number, rest = name[len(prefix) :].split(".", 1)
        if span.start <= int(number) < span.end:
            blocks.setdefault(int(number), {})[rest] = tensor
    return blocks


def _load_block(layer: nn.Module, tensors: dict[str, torch.Tensor], name: str, folder: Path, index: int) -> None:
    """Load one block's LoRA weights; every LoRA matrix injected into it must be in the file, and nothing else."""
    state = {}
    for stored, tensor in tensors.items():
        match = _LORA_TENSOR.fullmatch(stored)
        if match is None:
            raise ModelLoadError(f"{folder}: block {index} tensor {stored!r} is not a LoRA matrix")
        state[f"{match.group(1)}.{match.group(2)}.{name}.weight"] = tensor
    expected = {key for key, _ in layer.named_parameters() if f".{name}." in key and ".lora_" in key}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
        raise ModelLoadError(f"{folder}: block {index} lacks LoRA tensors {missing}, has unexpected {extra}")
    reference = next(layer.parameters())
    for key, tensor in state.items():
        parameter = layer.get_parameter(key)
        if parameter.shape != tensor.shape:
            raise ModelLoadError(
                f"{folder}: block {index} {key} has shape {tuple(tensor.shape)}, not {tuple(parameter.shape)}"
            )
        with torch.no_grad():
            parameter.copy_(tensor.to(reference.device, parameter.dtype))
