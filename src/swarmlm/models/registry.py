"""Decoder families by Hugging Face `model_type`: what differs between families is declared here, once each."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from swarmlm.errors import ModelLoadError

# Hugging Face's names of the attention kinds a layer may have (config.layer_types); the span builds one mask per kind
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ATTENTION_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)


def layer_kind_from_config(config: PretrainedConfig, layer_idx: int) -> str:
    """A layer's attention kind: config.layer_types when the family has per-layer kinds (Qwen2/3, Gemma 3), else a
    sliding window for every layer when the config sets one (Mistral, Mixtral, Phi-3), else full attention."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return str(layer_types[layer_idx])
    return SLIDING_ATTENTION if getattr(config, "sliding_window", None) else FULL_ATTENTION


def rotary_for_all_kinds(
    rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of one rotary embedding shared by every layer, whatever its attention kind."""
    cos, sin = rotary(hidden, position_ids)
    return cos, sin


def rotary_per_kind(
    rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of a rotary embedding with its own frequencies per attention kind (Gemma 3: local and global)."""
    cos, sin = rotary(hidden, position_ids, kind)
    return cos, sin


def plain_logits(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    return logits


def softcapped_logits(config: PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """cap * tanh(logits / cap) when the config sets final_logit_softcapping (Gemma), as the local model does."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def no_buffers(model: nn.Module) -> None:
    return None


def scaled_embedding_buffer(model: nn.Module) -> None:
    """The embedding's sqrt(hidden) scale (Gemma) is a buffer no checkpoint stores: recompute it from its scalar."""
    embedding = model.get_submodule("model.embed_tokens")
    embedding.embed_scale = torch.tensor(embedding.scalar_embed_scale)


def causal_layer_kind(config: PretrainedConfig, layer_idx: int) -> str:
    """config.layer_types; bidirectional attention (Gemma's embedding-model variant) is not a causal LM: refused."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError(f"{config.model_type!r} with use_bidirectional_attention is not a causal LM: unsupported")
    return layer_kind_from_config(config, layer_idx)


def stored_as_is(config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return tensors


@dataclass(frozen=True)
class ModelFamily:
    """How to build and name the parts of one decoder family, and the few places where families differ: the
    attention kind of each layer (masks), the rotary embedding per kind, and the final logits."""

    model_type: str
    block_class: type[nn.Module]  # one decoder layer: block_class(config, layer_idx); returns a tensor
    rotary_class: type[nn.Module]  # rotary_class(config), called through position_embeddings
    causal_lm_class: type[PreTrainedModel]  # the local HF model, used for its config class and generate() glue
    block_prefix: str = "model.layers."  # tensor names of block i start with f"{block_prefix}{i}."
    embed_name: str = "model.embed_tokens"  # the input embedding module (with its scaling, if any)
    norm_name: str = "model.norm"  # the final norm module
    head_name: str = "lm_head"  # the output projection
    # (config, layer_idx) -> one of ATTENTION_KINDS: which mask (and rotary) the layer gets
    layer_kind: Callable[[PretrainedConfig, int], str] = layer_kind_from_config
    # (rotary module, hidden, position_ids, kind) -> (cos, sin) for the layers of that kind
    position_embeddings: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rotary_for_all_kinds
    # (config, one block's tensors as stored, named relative to the block) -> the block module's state dict: for
    # families whose checkpoints keep a layout transformers converts on load (Mixtral's per-expert matrices)
    block_state: Callable[[PretrainedConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]] = stored_as_is
    # (causal LM) -> None: recompute buffers of the client's parts that checkpoints do not store (they are built on
    # the meta device); the rotary embedding is rebuilt for every family
    client_buffers: Callable[[nn.Module], None] = no_buffers
    # (config, logits) -> logits: what the local model does after its LM head (soft-capping)
    final_logits: Callable[[PretrainedConfig, torch.Tensor], torch.Tensor] = plain_logits
    # the family's own eager attention, for layers that sdpa cannot run (Gemma 2 soft-caps attention logits); its
    # layers then run Hugging Face's "eager" implementation. None: "sdpa"
    eager_attention: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None

    @property
    def attn_implementation(self) -> str:
        """The Hugging Face attention implementation the family's layers run with."""
        return "sdpa" if self.eager_attention is None else "eager"

    def block_tensor_prefix(self, index: int) -> str:
        return f"{self.block_prefix}{index}."

    @property
    def client_tensor_prefixes(self) -> tuple[str, ...]:
        return (f"{self.embed_name}.", f"{self.norm_name}.", f"{self.head_name}.")

    def layer_kinds(self, config: PretrainedConfig) -> list[str]:
        """The attention kind of every layer; a kind this code does not build masks for is a load error."""
        kinds = [self.layer_kind(config, i) for i in range(config.num_hidden_layers)]
        unknown = sorted(set(kinds) - set(ATTENTION_KINDS))
        if unknown:
            raise ModelLoadError(f"{config.model_type!r} layers use attention kinds {unknown}, not supported yet")
        if SLIDING_ATTENTION in kinds and not getattr(config, "sliding_window", None):
            raise ModelLoadError(f"{config.model_type!r} has sliding-window layers but no sliding_window size")
        return kinds


_FAMILIES: dict[str, ModelFamily] = {}
# the built-in families' files by model_type, imported on first use: each imports its transformers modeling module
_BUILT_IN = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mixtral": "mixtral",
}


def register_family(family: ModelFamily) -> ModelFamily:
    _FAMILIES[family.model_type] = family
    return family


def _registered(model_type: str) -> ModelFamily | None:
    if model_type not in _FAMILIES and model_type in _BUILT_IN:
        importlib.import_module(f"swarmlm.models.{_BUILT_IN[model_type]}")  # registers itself
    return _FAMILIES.get(model_type)


def attn_implementation(model_type: str) -> str:
    """The attention implementation layers of `model_type` run with: the family's, or "sdpa" for a type that is not
    supported (the error comes when the family itself is asked for)."""
    family = _registered(model_type)
    return "sdpa" if family is None else family.attn_implementation


def get_family(config: PretrainedConfig) -> ModelFamily:
    """The family of a config; a clear error lists what is supported."""
    return family_of(config.model_type)


def family_of(model_type: str) -> ModelFamily:
    """The family of a config's model_type; a clear error lists what is supported."""
    family = _registered(model_type)
    if family is None:
        supported = ", ".join(sorted({*_FAMILIES, *_BUILT_IN}))
        raise ModelLoadError(f"model_type {model_type!r} is not supported yet; supported: {supported}")
    return family
