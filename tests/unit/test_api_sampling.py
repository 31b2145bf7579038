"""The API's sampling rules (logit_bias, penalties, top_k, min_p), an echoed prompt's log-probability lists, and the
merge of a request's several prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from swarmlm.api.completions import merged, total
from swarmlm.api.engine import Delta, SamplingParams, TokenLogprob, Usage, next_tokens
from swarmlm.api.logprobs import TokenNames, completion_lists
from swarmlm.api.sampling import LogitRules, Penalties, filtered_probs


def test_default_rules_change_nothing() -> None:
    logits = torch.randn(2, 10)
    assert torch.equal(Penalties(LogitRules(), [1, 2], 2, 10).apply(logits), logits)


def test_frequency_and_presence_penalties_follow_openais_rule_over_generated_tokens() -> None:
    rules = LogitRules(presence_penalty=0.5, frequency_penalty=0.25)
    penalties = Penalties(rules, prompt=[4, 4, 4], rows=2, vocab=6)  # the prompt does not count
    generated = [[1, 1, 3], [2, 2, 2]]  # per row
    for step in range(3):
        penalties.add(torch.tensor([generated[0][step], generated[1][step]]))
    logits = torch.zeros(2, 6)
    expected = torch.zeros(2, 6)
    for row, tokens in enumerate(generated):
        for token in set(tokens):
            expected[row, token] -= tokens.count(token) * 0.25 + 0.5
    assert torch.allclose(penalties.apply(logits), expected)


def test_repetition_penalty_equals_hugging_faces_over_prompt_and_generated_tokens() -> None:
    logits = torch.randn(2, 12) * 3
    prompt, generated = [1, 5, 5, 7], torch.tensor([[2, 9], [7, 11]])  # (rows, steps)
    penalties = Penalties(LogitRules(repetition_penalty=1.7), prompt, rows=2, vocab=12)
    for step in range(generated.shape[1]):
        penalties.add(generated[:, step])
    sequences = torch.cat([torch.tensor([prompt, prompt]), generated], dim=1)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(sequences, logits.clone())
    assert torch.allclose(penalties.apply(logits), expected)


def test_logit_bias_moves_the_greedy_choice_and_can_forbid_a_token() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    biased = Penalties(LogitRules(logit_bias=((1, -100.0), (3, 7.5))), [], rows=1, vocab=4).apply(logits)
    assert torch.allclose(biased, torch.tensor([[0.0, -95.0, 4.9, 4.5]]))
    assert next_tokens(biased, SamplingParams(1, temperature=0), torch.Generator()).tolist() == [2]


def test_top_k_and_min_p_keep_only_the_likely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filtered_probs(logits, 1.0, 1.0, LogitRules(top_k=2))
    assert (kept > 0).tolist() == [[True, True, False, False]]
    kept = filtered_probs(logits, 1.0, 1.0, LogitRules(min_p=0.2))  # 0.2 * 0.5: drops 0.05 only
    assert (kept > 0).tolist() == [[True, True, True, False]]
    kept = filtered_probs(logits, 1.0, 0.6, LogitRules(top_k=3))  # top_p of the renormalized top 3: 0.53, 0.32
    assert (kept > 0).tolist() == [[True, True, False, False]]
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(1, temperature=1.0, rules=LogitRules(top_k=1))
    assert {next_tokens(logits, params, generator).item() for _ in range(50)} == {0}
    free = SamplingParams(1, temperature=1.0)
    assert {next_tokens(logits, free, generator).item() for _ in range(300)} == {0, 1, 2, 3}


class ByteTokenizer:
    """convert_ids_to_tokens of a byte-level tokenizer whose token i is the letter 'a' + i."""

    backend_tokenizer = type("Backend", (), {"decoder": type("ByteLevel", (), {})()})()

    def convert_ids_to_tokens(self, token: int) -> str:
        return chr(ord("a") + token)


def test_an_echoed_prompts_first_token_has_null_logprobs() -> None:
    entries = [TokenLogprob(0, None, (), 0), TokenLogprob(1, -1.5, ((2, -0.5),), 1), TokenLogprob(2, -0.1, (), 2)]
    lists = completion_lists(entries, TokenNames(ByteTokenizer()))
    assert lists == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -1.5, -0.1],
        "top_logprobs": [None, {"c": -0.5, "b": -1.5}, {"c": -0.1}],
        "text_offset": [0, 1, 2],
    }


async def deltas(items: list[Delta], usage: list[Usage], fail: bool = False) -> AsyncGenerator[Delta]:
    for item in items:
        await asyncio.sleep(0.001)
        yield item
    if fail:
        raise RuntimeError("the swarm broke")
    usage.append(Usage(3, len(items)))


def test_several_prompts_merge_with_openais_choice_numbers() -> None:
    async def run() -> tuple[list[Delta], Usage]:
        usage: list[Usage] = []
        streams = [deltas([Delta(0, "a"), Delta(1, "b"), Delta(0, "c", "stop")], usage),
                   deltas([Delta(1, "x", "length"), Delta(0, "y", "stop")], usage)]  # fmt: skip
        return [delta async for delta in merged(streams, n=2)], total(usage)

    out, usage = asyncio.run(run())
    texts = {index: "".join(d.text for d in out if d.index == index) for index in range(4)}
    assert texts == {0: "ac", 1: "b", 2: "y", 3: "x"} and usage == Usage(6, 5)


def test_a_failing_prompt_fails_the_merge() -> None:
    async def run() -> None:
        usage: list[Usage] = []
        streams = [deltas([Delta(0, "a")] * 50, usage), deltas([Delta(0, "x")], usage, fail=True)]
        async for _ in merged(streams, n=1):
            pass

    with pytest.raises(RuntimeError, match="the swarm broke"):
        asyncio.run(run())
