"""Speculative decoding through a real swarm of the bundled SmolLM2: greedy output unchanged, fewer steps."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.client.inference import InferenceSession
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import connected_model, load_reference, running_swarm

# a task whose answer copies its input: prompt lookup finds most of the output in the prompt
COPY_TASK = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank."


def copy_task(tokenizer: AutoTokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": COPY_TASK}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def reference(smollm_dir: Path) -> torch.nn.Module:
    return load_reference(smollm_dir)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def two_servers(smollm_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(smollm_dir, [(0, 15), (15, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(smollm_dir: Path, two_servers: LocalSwarm) -> Iterator[torch.nn.Module]:
    with connected_model(smollm_dir, two_servers) as model:
        yield model


def local_greedy(reference: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.inference_mode():
        return reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)


def counting_steps(session: InferenceSession) -> list[int]:
    """Records the number of tokens of each step the session sends to the servers."""
    sizes: list[int] = []
    step = session.step

    def counted(inputs: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        sizes.append(inputs.shape[1])
        return step(inputs, *args, **kwargs)

    session.step = counted  # type: ignore[method-assign]
    return sizes


def test_prompt_lookup_equals_greedy_in_fewer_steps(model, reference, tokenizer) -> None:
    ids = copy_task(tokenizer)
    expected = local_greedy(reference, ids, 24)
    with model.inference_session(max_length=ids.shape[1] + 24) as session:
        steps = counting_steps(session)
        output = model.generate(ids, max_new_tokens=24, prompt_lookup_num_tokens=8, session=session)
    assert output.tolist() == expected.tolist()
    made = output.shape[1] - ids.shape[1]
    assert "lazy dog" in tokenizer.decode(output[0, ids.shape[1] :])
    assert len(steps) <= made / 2, f"prompt lookup should accept copied tokens several at a time: steps {steps}"


def test_a_draft_model_with_the_same_weights_is_always_accepted(model, reference, tokenizer) -> None:
    ids = tokenizer("The history of the printing press", return_tensors="pt").input_ids
    expected = local_greedy(reference, ids, 20)
    with model.inference_session(max_length=ids.shape[1] + 20) as session:
        steps = counting_steps(session)
        output = model.generate(
            ids, max_new_tokens=20, assistant_model=reference, num_assistant_tokens=4, session=session
        )
    assert output.tolist() == expected.tolist()
    # the prompt with 4 proposals, then 5 tokens a round: every proposal is the model's own choice
    assert len(steps) == 4, steps


def test_a_weaker_draft_changes_only_the_number_of_steps(model, reference, tokenizer) -> None:
    draft = copy.deepcopy(reference)  # the first 8 of the 30 layers: a cheap draft that is often, not always, right
    draft.model.layers = draft.model.layers[:8]
    draft.config.num_hidden_layers = 8
    ids = tokenizer("Once upon a time, in a small village", return_tensors="pt").input_ids
    expected = local_greedy(reference, ids, 24)
    output = model.generate(ids, max_new_tokens=24, assistant_model=draft)
    assert output.tolist() == expected.tolist()


def test_speculative_and_plain_steps_continue_one_session(model, reference, tokenizer) -> None:
    ids = copy_task(tokenizer)
    expected = local_greedy(reference, ids, 11)  # the answer is 11 tokens, the last is the end of sequence
    with model.inference_session(max_length=ids.shape[1] + 11) as session:
        first = model.generate(ids, max_new_tokens=5, prompt_lookup_num_tokens=6, session=session)
        second = model.generate(None, max_new_tokens=3, do_sample=False, session=session)
        third = model.generate(None, max_new_tokens=3, prompt_lookup_num_tokens=6, session=session)
    assert torch.cat([first, second, third], dim=1).tolist() == expected.tolist()


def test_an_end_of_sequence_token_stops_speculative_generation(model, reference, tokenizer) -> None:
    ids = copy_task(tokenizer)
    expected = local_greedy(reference, ids, 24)[0, ids.shape[1] :]
    stop = int(expected[5])  # a token of the answer stands in for the end-of-sequence token
    first = int((expected == stop).nonzero()[0])
    output = model.generate(ids, max_new_tokens=24, prompt_lookup_num_tokens=8, eos_token_id=stop)
    assert output[0, ids.shape[1] :].tolist() == expected[: first + 1].tolist()


def test_options_speculative_decoding_cannot_honour_are_refused(model, tokenizer) -> None:
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="greedy only"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3, do_sample=True)
    with pytest.raises(ValueError, match="one sequence at a time"):
        model.generate(ids.repeat(2, 1), max_new_tokens=4, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3, repetition_penalty=1.2)
    # the model still generates after the refusals
    assert model.generate(ids, max_new_tokens=2, prompt_lookup_num_tokens=3).shape[1] == ids.shape[1] + 2
