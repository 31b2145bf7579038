"""Qwen2: biases on the q/k/v projections; with use_sliding_window, layers from max_window_layers on use a window
(config.layer_types says which)."""

from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2RotaryEmbedding

from swarmlm.models.registry import ModelFamily, register_family

QWEN2 = register_family(ModelFamily("qwen2", Qwen2DecoderLayer, Qwen2RotaryEmbedding, Qwen2ForCausalLM))
