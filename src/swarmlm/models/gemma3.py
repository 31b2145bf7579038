"""Gemma 3 (text): (1 + weight) RMS norms around attention and MLP, embeddings scaled by sqrt(hidden) inside the
embedding module, local (sliding) and global layers with their own rotary frequencies, and optionally soft-capped
final logits."""

from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3RotaryEmbedding,
)

from swarmlm.models.registry import (
    ModelFamily,
    causal_layer_kind,
    register_family,
    rotary_per_kind,
    scaled_embedding_buffer,
    softcapped_logits,
)

GEMMA3 = register_family(
    ModelFamily(
        "gemma3_text",
        Gemma3DecoderLayer,
        Gemma3RotaryEmbedding,
        Gemma3ForCausalLM,
        layer_kind=causal_layer_kind,
        client_buffers=scaled_embedding_buffer,
        position_embeddings=rotary_per_kind,
        final_logits=softcapped_logits,
    )
)
