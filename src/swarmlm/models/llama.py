"""The Llama family: a new decoder family with the same layer layout is one file like this one."""

from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaRotaryEmbedding

from swarmlm.models.registry import ModelFamily, register_family

LLAMA = register_family(ModelFamily("llama", LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaForCausalLM))
