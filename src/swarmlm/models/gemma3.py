"""Gemma 3 (text): (1 + weight) RMS norms around attention and MLP, embeddings scaled by sqrt(hidden) inside the
embedding module, local (sliding) and global layers with their own rotary frequencies, and optionally soft-capped
final logits."""

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3RotaryEmbedding,
)

from swarmlm.errors import ModelLoadError
from swarmlm.models.registry import (
    ModelFamily,
    layer_kind_from_config,
    register_family,
    rotary_per_kind,
    softcapped_logits,
)


def scaled_embedding_buffer(model: nn.Module) -> None:
    """The embedding's sqrt(hidden) scale is a buffer no checkpoint stores: recompute it from its scalar."""
    embedding = model.get_submodule("model.embed_tokens")
    embedding.embed_scale = torch.tensor(embedding.scalar_embed_scale)


def gemma3_layer_kind(config: PretrainedConfig, layer_idx: int) -> str:
    """config.layer_types; bidirectional attention (an embedding-model variant) is not a causal LM and is refused."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError("Gemma 3 with use_bidirectional_attention is not a causal LM: not supported")
    return layer_kind_from_config(config, layer_idx)


GEMMA3 = register_family(
    ModelFamily(
        "gemma3_text",
        Gemma3DecoderLayer,
        Gemma3RotaryEmbedding,
        Gemma3ForCausalLM,
        layer_kind=gemma3_layer_kind,
        client_buffers=scaled_embedding_buffer,
        position_embeddings=rotary_per_kind,
        final_logits=softcapped_logits,
    )
)
