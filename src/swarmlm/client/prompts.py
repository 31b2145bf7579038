"""Prompt tuning ("ptune") and deep prompt tuning ("deep_ptune"): the client's own trainable parameters."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

TUNING_MODES = ("ptune", "deep_ptune")
PROMPTS_FILE = "prompts.safetensors"
META_FILE = "prompts.json"
# label of positions excluded from the loss, as in Hugging Face's causal-LM loss
IGNORE_INDEX = -100


class PromptTuning(nn.Module):
    """pre_seq_len trainable embeddings prepended to the input; with deep_ptune also a (pre_seq_len, hidden)
    prompt per block, added to the first pre_seq_len positions of that block's input on the servers."""

    def __init__(self, mode: str, pre_seq_len: int, hidden_size: int, num_blocks: int, init_std: float = 0.02):
        super().__init__()
        if mode not in TUNING_MODES:
            raise ValueError(f"tuning_mode must be one of {TUNING_MODES}, not {mode!r}")
        if pre_seq_len < 1:
            raise ValueError(f"pre_seq_len must be at least 1, not {pre_seq_len}")
        self.mode, self.pre_seq_len = mode, pre_seq_len
        self.prompt_embeddings = nn.Parameter(torch.randn(pre_seq_len, hidden_size) * init_std)
        # zeros: before training, deep prompts change nothing beyond the prepended embeddings
        self.deep_prompts = (
            nn.Parameter(torch.zeros(num_blocks, pre_seq_len, hidden_size)) if mode == "deep_ptune" else None
        )

    def extend(
        self,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Prepend the prompt to embeds (batch, seq, hidden); extend the mask and shift given positions."""
        batch, n = embeds.shape[0], self.pre_seq_len
        prompt = self.prompt_embeddings.to(embeds.dtype).unsqueeze(0).expand(batch, -1, -1)
        embeds = torch.cat([prompt, embeds], dim=1)
        attention_mask = self.extend_mask(attention_mask)
        if position_ids is not None:
            prefix = torch.arange(n, device=position_ids.device).unsqueeze(0).expand(batch, -1)
            position_ids = torch.cat([prefix, position_ids + n], dim=1)
        return embeds, attention_mask, position_ids

    def extend_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask (batch, length) of a sequence with the prompt in front: ones for the prompt positions."""
        if attention_mask is None:
            return None
        return torch.cat([attention_mask.new_ones(attention_mask.shape[0], self.pre_seq_len), attention_mask], dim=1)

    def save(self, directory: str | os.PathLike) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: p.detach().cpu().contiguous() for name, p in self.named_parameters()}, directory / PROMPTS_FILE
        )
        meta = {"tuning_mode": self.mode, "pre_seq_len": self.pre_seq_len}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))
        return directory

    def load(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        meta = json.loads((directory / META_FILE).read_text())
        if meta != {"tuning_mode": self.mode, "pre_seq_len": self.pre_seq_len}:
            raise ValueError(
                f"{directory} holds {meta['tuning_mode']} prompts of length {meta['pre_seq_len']}; this model uses "
                f"{self.mode} with pre_seq_len={self.pre_seq_len}"
            )
        tensors = load_file(directory / PROMPTS_FILE)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if tensors[name].shape != param.shape:
                    raise ValueError(f"{name} in {directory} has shape {tuple(tensors[name].shape)}")
                param.copy_(tensors[name])
