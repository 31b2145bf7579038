"""Gemma 2: (1 + weight) RMS norms before and after both attention and MLP, embeddings scaled by sqrt(hidden) inside
the embedding module, alternating local (sliding) and global layers sharing one rotary embedding, queries scaled by
query_pre_attn_scalar, and soft-capped attention logits and final logits.

Soft-capping the attention logits (cap * tanh(scores / cap)) happens between the product and the softmax, which
sdpa cannot do: the layers run Hugging Face's eager attention, as the local model does."""

from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2RotaryEmbedding,
    eager_attention_forward,
)

from swarmlm.models.registry import (
    ModelFamily,
    causal_layer_kind,
    register_family,
    scaled_embedding_buffer,
    softcapped_logits,
)

GEMMA2 = register_family(
    ModelFamily(
        "gemma2",
        Gemma2DecoderLayer,
        Gemma2RotaryEmbedding,
        Gemma2ForCausalLM,
        layer_kind=causal_layer_kind,
        client_buffers=scaled_embedding_buffer,
        final_logits=softcapped_logits,
        eager_attention=eager_attention_forward,
    )
)
