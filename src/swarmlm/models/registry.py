"""Decoder families by Hugging Face `model_type`: what differs between families is declared here, once each."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from swarmlm.errors import ModelLoadError


@dataclass(frozen=True)
class ModelFamily:
    """How to build and name the parts of one decoder family (Llama and its close relatives share the shape)."""

    model_type: str
    block_class: type[nn.Module]  # one decoder layer: block_class(config, layer_idx)
    rotary_class: type[nn.Module]  # rotary_class(config)(hidden, position_ids) -> (cos, sin)
    causal_lm_class: type[PreTrainedModel]  # the local HF model, used for its config class and generate() glue
    block_prefix: str = "model.layers."  # tensor names of block i start with f"{block_prefix}{i}."
    embed_name: str = "model.embed_tokens"  # the input embedding module, relative to the causal LM
    norm_name: str = "model.norm"  # the final norm module
    head_name: str = "lm_head"  # the output projection

    def block_tensor_prefix(self, index: int) -> str:
        return f"{self.block_prefix}{index}."

    @property
    def client_tensor_prefixes(self) -> tuple[str, ...]:
        return (f"{self.embed_name}.", f"{self.norm_name}.", f"{self.head_name}.")


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    _FAMILIES[family.model_type] = family
    return family


def get_family(config: PretrainedConfig) -> ModelFamily:
    """The family of a config; a clear error lists what is supported."""
    from swarmlm.models import llama  # noqa: F401  (registers the built-in families)

    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise ModelLoadError(
            f"model_type {config.model_type!r} is not supported yet; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return family
