"""Prompt tuning parameters: how they extend inputs, and saving/loading them as a small file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmlm.client.prompts import PROMPTS_FILE, PromptTuning


def test_extend_prepends_prompts_and_shifts_masks_and_positions() -> None:
    tuning = PromptTuning("ptune", pre_seq_len=3, hidden_size=8, num_blocks=4)
    embeds = torch.randn(2, 5, 8)
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
    out, out_mask, out_positions = tuning.extend(embeds, mask, positions)
    assert out.shape == (2, 8, 8) and torch.equal(out[:, 3:], embeds)
    assert torch.equal(out[0, :3], tuning.prompt_embeddings.detach())
    assert out_mask[:, :3].all() and torch.equal(out_mask[:, 3:], mask)
    assert out_positions[0].tolist() == [0, 1, 2, 3, 3, 4, 5, 6]
    assert tuning.deep_prompts is None


def test_deep_prompts_start_at_zero_and_are_trainable() -> None:
    tuning = PromptTuning("deep_ptune", pre_seq_len=2, hidden_size=8, num_blocks=4)
    assert tuning.deep_prompts.shape == (4, 2, 8) and not tuning.deep_prompts.any()
    assert all(p.requires_grad for p in tuning.parameters())


def test_save_and_load_roundtrip(tmp_path: Path) -> None:
    trained = PromptTuning("deep_ptune", pre_seq_len=2, hidden_size=8, num_blocks=4)
    with torch.no_grad():
        trained.deep_prompts.normal_()
    trained.save(tmp_path)
    assert (tmp_path / PROMPTS_FILE).stat().st_size < 4096
    fresh = PromptTuning("deep_ptune", pre_seq_len=2, hidden_size=8, num_blocks=4)
    fresh.load(tmp_path)
    for a, b in zip(trained.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="deep_ptune prompts of length 2"):
        PromptTuning("ptune", pre_seq_len=2, hidden_size=8, num_blocks=4).load(tmp_path)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="tuning_mode"):
        PromptTuning("lora", 2, 8, 4)
    with pytest.raises(ValueError, match="pre_seq_len"):
        PromptTuning("ptune", 0, 8, 4)
