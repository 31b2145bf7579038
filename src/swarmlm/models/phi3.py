"""Phi-3: fused qkv and gate/up projections, partial rotary embeddings; an optional window on every layer."""

from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3ForCausalLM, Phi3RotaryEmbedding

from swarmlm.models.registry import ModelFamily, register_family

PHI3 = register_family(ModelFamily("phi3", Phi3DecoderLayer, Phi3RotaryEmbedding, Phi3ForCausalLM))
