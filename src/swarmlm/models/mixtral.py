"""Mixtral: a sparse mixture of experts in every block (each token routed to its top-k experts); the router's
auxiliary loss is a training-only output that the blocks' hidden states do not depend on."""

from __future__ import annotations

import re

import torch
from transformers import PretrainedConfig
from transformers.models.mixtral.modeling_mixtral import (
    MixtralDecoderLayer,
    MixtralForCausalLM,
    MixtralRotaryEmbedding,
)

from swarmlm.errors import ModelLoadError
from swarmlm.models.registry import ModelFamily, register_family

_STORED_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def fused_experts(config: PretrainedConfig, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One block's tensors as checkpoints store them (block_sparse_moe.experts.E.w1/w2/w3, gate) -> the layout of
    transformers' module (mlp.gate, mlp.experts.gate_up_proj (E, 2 * inter, hidden) with gate rows first, and
    mlp.experts.down_proj (E, hidden, inter)), as transformers converts them on load; fused tensors pass as is."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {"w1": {}, "w2": {}, "w3": {}}
    for name, tensor in stored.items():
        match = _STORED_EXPERT.fullmatch(name)
        if match:
            experts[match.group(2)][int(match.group(1))] = tensor
        else:
            state[name.replace("block_sparse_moe.", "mlp.", 1)] = tensor
    if not any(experts.values()):
        return state
    count = config.num_local_experts
    for kind, found in experts.items():
        if sorted(found) != list(range(count)):
            raise ModelLoadError(f"a Mixtral block stores {kind} of experts {sorted(found)}, not of all {count}")

    def stacked(kind: str) -> torch.Tensor:
        return torch.stack([experts[kind][e] for e in range(count)])

    state["mlp.experts.gate_up_proj"] = torch.cat([stacked("w1"), stacked("w3")], dim=1)
    state["mlp.experts.down_proj"] = stacked("w2")
    return state


MIXTRAL = register_family(
    ModelFamily("mixtral", MixtralDecoderLayer, MixtralRotaryEmbedding, MixtralForCausalLM, block_state=fused_experts)
)
