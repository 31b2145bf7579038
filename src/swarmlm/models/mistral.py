"""Mistral: Llama's layout with a sliding attention window on every layer (config.sliding_window)."""

from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralForCausalLM,
    MistralRotaryEmbedding,
)

from swarmlm.models.registry import ModelFamily, register_family

MISTRAL = register_family(ModelFamily("mistral", MistralDecoderLayer, MistralRotaryEmbedding, MistralForCausalLM))
