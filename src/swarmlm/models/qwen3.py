"""Qwen3: RMS norms on queries and keys inside attention; per-layer attention kinds as in Qwen2."""

from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3RotaryEmbedding

from swarmlm.models.registry import ModelFamily, register_family

QWEN3 = register_family(ModelFamily("qwen3", Qwen3DecoderLayer, Qwen3RotaryEmbedding, Qwen3ForCausalLM))
