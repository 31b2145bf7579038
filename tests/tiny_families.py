"""Tiny random checkpoints of every supported decoder family, built from a config (2-4 layers, hidden 64)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

# a window shorter than the test prompts, so that sliding-window layers really drop old tokens
WINDOW = 4
COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def tiny_config(model_type: str) -> PretrainedConfig:
    """Each family's distinguishing features turned on: windows, per-layer kinds, biases, q/k norms, experts."""
    if model_type == "llama":
        return LlamaConfig(**COMMON)
    if model_type == "mistral":
        return MistralConfig(**COMMON, sliding_window=WINDOW)  # every layer slides
    if model_type == "qwen2":
        # layers 2 and 3 slide, 0 and 1 attend to everything: two mask kinds in one span
        return Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    if model_type == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16)
    if model_type == "gemma3_text":
        # local (sliding) and global layers alternate, each kind with its own rotary base; capped logits
        options = {**COMMON, "tie_word_embeddings": True}
        return Gemma3TextConfig(
            **options, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2, final_logit_softcapping=3.0,
            query_pre_attn_scalar=16,
        )  # fmt: skip
    if model_type == "gemma2":
        # sliding and global layers alternate; weights large enough and caps low enough that both soft-cappings
        # change the logits (by ~0.6 and ~0.8 here: without either, the logits test fails)
        options = {**COMMON, "tie_word_embeddings": True}
        return Gemma2Config(
            **options, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0, initializer_range=0.1,
        )  # fmt: skip
    if model_type == "phi3":
        return Phi3Config(**COMMON, partial_rotary_factor=0.5)
    if model_type == "mixtral":
        return MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(model_type)


FAMILIES = ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral")


def build_tiny(model_type: str, folder: Path, seed: int = 0) -> Path:
    """Saves a random model of the family to `folder`. Biases and norm weights, which Hugging Face initializes to
    constants, are perturbed so that a family's biases and norm conventions change the outputs."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(folder)
    return folder


def build_adapter(model_dir: Path, folder: Path, seed: int, **lora: Any) -> Path:
    """A random PEFT LoRA adapter of the model in `model_dir`, saved to `folder` (its name is the adapter's name).
    Its B matrices are random too (PEFT starts them at zero), so that the adapter changes the outputs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], **lora}
    get_peft_model(base, LoraConfig(init_lora_weights=False, **options)).save_pretrained(folder)
    return folder


def load_peft_reference(model_dir: Path, adapter: Path) -> torch.nn.Module:
    """The local PEFT model: the whole model with the adapter, in fp32."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()
