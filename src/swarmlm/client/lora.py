"""LoRA tuning ("lora"): the client owns the LoRA matrices of every remote block and sends them with its requests;
saved as a standard PEFT adapter folder, which `swarmlm serve --adapters` serves and PEFT loads."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from swarmlm.errors import ConfigError
from swarmlm.models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from swarmlm.models.lora import linear_shapes
from swarmlm.models.registry import ModelFamily
from swarmlm.protocol.lora import LoraLayout, LoraSpec, LoraWeights, lora_layout, peft_scaling

if TYPE_CHECKING:
    from peft import LoraConfig

# PEFT's defaults for a causal LM's LoRA
DEFAULT_RANK = 8
DEFAULT_ALPHA = 16
DEFAULT_TARGETS = ("q_proj", "v_proj")
# what PEFT prefixes a causal LM's tensor names with in a saved adapter
_PEFT_PREFIX = "base_model.model."


def block_shapes(config: PretrainedConfig, family: ModelFamily) -> list[dict[str, tuple[int, int]]]:
    """The Linear modules of every block of the model, name -> (in, out), read from blocks built on the meta device
    (no memory): the servers derive the same from their real blocks."""
    with torch.device("meta"):
        return [linear_shapes(family.block_class(config, layer_idx=i)) for i in range(config.num_hidden_layers)]


class LoraTuning(nn.Module):
    """LoRA matrices A (rank, in) and B (out, rank) of the target modules of every block, initialized as PEFT does
    (A Kaiming-uniform, B zeros: before training the model is unchanged). No dropout: the servers apply
    x -> x W^T + scaling * B(A(x)) exactly."""

    def __init__(
        self, config: PretrainedConfig, family: ModelFamily, model_name: str, rank: int = DEFAULT_RANK,
        alpha: int = DEFAULT_ALPHA, targets: Sequence[str] = DEFAULT_TARGETS,
    ):  # fmt: skip
        super().__init__()
        self.spec = LoraSpec(rank=rank, scaling=peft_scaling(rank, alpha), targets=tuple(targets))
        self.alpha, self.family, self.model_name = alpha, family, model_name
        try:
            self.layout: LoraLayout = lora_layout(block_shapes(config, family), rank, self.spec.targets)
        except ValueError as e:
            raise ConfigError(f"lora_target_modules {list(targets)} do not fit this model: {e}") from e
        self.lora_A, self.lora_B = nn.ParameterList(), nn.ParameterList()
        for block in self.layout.modules:
            for _, fan_in, fan_out in block:
                a = torch.empty(rank, fan_in)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as PEFT (and nn.Linear) initialize lora_A
                self.lora_A.append(nn.Parameter(a))
                self.lora_B.append(nn.Parameter(torch.zeros(fan_out, rank)))

    def names(self) -> list[str]:
        """PEFT's name of each module adapted here (without .lora_A.weight), in parameter order."""
        prefix = _PEFT_PREFIX + self.family.block_prefix
        return [f"{prefix}{index}.{name}" for index, block in enumerate(self.layout.modules) for name, _, _ in block]

    def weights(self) -> LoraWeights:
        """All blocks' matrices as the one flat tensor requests carry (differentiable wrt the parameters)."""
        parts = [t.reshape(-1) for a, b in zip(self.lora_A, self.lora_B, strict=True) for t in (a, b)]
        return LoraWeights(self.spec, self.layout, torch.cat(parts), 0)

    def peft_config(self) -> LoraConfig:
        """The PEFT config of these weights (a causal LM's LoRA)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.spec.rank, lora_alpha=self.alpha, target_modules=list(self.spec.targets), lora_dropout=0.0,
            task_type="CAUSAL_LM", base_model_name_or_path=self.model_name,
        )  # fmt: skip

    def save(self, directory: str | os.PathLike) -> Path:
        """Write a PEFT adapter folder: adapter_config.json and adapter_model.safetensors."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, a, b in zip(self.names(), self.lora_A, self.lora_B, strict=True):
            tensors[f"{name}.lora_A.weight"] = a.detach().cpu().contiguous()
            tensors[f"{name}.lora_B.weight"] = b.detach().cpu().contiguous()
        save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        self.peft_config().save_pretrained(str(directory))  # adapter_config.json, as PEFT writes it
        return directory

    def load(self, directory: str | os.PathLike) -> None:
        """Load weights saved by save() (or by PEFT) for the same rank, alpha and target modules."""
        directory = Path(directory)
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
        targets = config.get("target_modules")
        found = (config.get("peft_type"), config.get("r"), config.get("lora_alpha"), sorted(targets or []))
        wanted = ("LORA", self.spec.rank, self.alpha, sorted(self.spec.targets))
        if found != wanted:
            raise ValueError(
                f"{directory} holds a {found[0]} adapter with r={found[1]}, lora_alpha={found[2]}, target_modules="
                f"{found[3]}; this model uses r={self.spec.rank}, lora_alpha={self.alpha}, {wanted[3]}"
            )
        tensors = load_file(directory / ADAPTER_WEIGHTS)
        expected = {f"{n}.lora_{m}.weight" for n in self.names() for m in "AB"}
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
            raise ValueError(f"{directory} lacks LoRA tensors {missing}, has unexpected {extra}")
        with torch.no_grad():
            for name, a, b in zip(self.names(), self.lora_A, self.lora_B, strict=True):
                for param, key in ((a, f"{name}.lora_A.weight"), (b, f"{name}.lora_B.weight")):
                    if tensors[key].shape != param.shape:
                        raise ValueError(f"{key} in {directory} has shape {tuple(tensors[key].shape)}")
                    param.copy_(tensors[key])
