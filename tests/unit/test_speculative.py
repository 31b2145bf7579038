"""Proposals for speculative decoding: prompt lookup and a draft model's cache reuse."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swarmlm.client.speculative import DraftModel, PromptLookup


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_ngram() -> None:
    ids = torch.tensor([[5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7]])
    # "6 7" occurred twice before; the latest is followed by 3 4 8
    assert PromptLookup().propose(ids, 3).tolist() == [3, 4, 8]
    # the longer n-gram "8 6 7" never occurred, "2 9 6 7" neither: the bigram decides; count bounds the proposal
    assert PromptLookup().propose(ids, 1).tolist() == [3]


def test_prompt_lookup_prefers_the_longer_ngram() -> None:
    ids = torch.tensor([[1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3]])
    # the unigram "3" last occurred before 20, but the trigram "1 2 3" occurred before 10
    assert PromptLookup().propose(ids, 2).tolist() == [10, 11]


def test_prompt_lookup_without_a_match_proposes_nothing() -> None:
    assert PromptLookup().propose(torch.tensor([[1, 2, 3, 4]]), 4).tolist() == []
    assert PromptLookup().propose(torch.tensor([[7]]), 4).tolist() == []


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def greedy(model: LlamaForCausalLM, ids: torch.Tensor, count: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False, min_new_tokens=count
        )
    return out[0, ids.shape[1] :].tolist()


def test_a_draft_proposes_its_greedy_continuation_and_reuses_its_cache_after_a_rejection() -> None:
    model = tiny_model()
    draft = DraftModel(model)
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    first = draft.propose(ids, 4)
    assert first.tolist() == greedy(model, ids, 4)
    # two proposals accepted, then another token than the third: the draft continues from there
    ids = torch.cat([ids, first[None, :2], torch.tensor([[(int(first[2]) + 1) % 64]])], dim=1)
    assert draft.seen is not None and draft.seen.shape[1] == 8
    second = draft.propose(ids, 3)
    assert second.tolist() == greedy(model, ids, 3)
    assert draft.propose(ids, 0).tolist() == []


def test_min_new_tokens_keeps_end_of_sequence_out_of_the_first_tokens_as_generate_does() -> None:
    from swarmlm.client.speculative import speculative_generate

    model = tiny_model()
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    eos = greedy(model, ids, 1)[0]  # the model's very next token stands in for the end of sequence

    class Session:  # the session interface speculative_generate uses; the forward recomputes the whole sequence
        token_ids = None
        prefix_tokens = 0
        position = 0

    def forward(session: object, candidate: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(candidate).logits

    out = speculative_generate(forward, Session(), ids, PromptLookup(), 3, 6, [eos], min_new_tokens=4)  # type: ignore[arg-type]
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=4,
                                  do_sample=False, eos_token_id=eos, pad_token_id=0)  # fmt: skip
    assert out.tolist() == expected.tolist()
