"""generate() through real swarms of the bundled SmolLM2 equals local generate(), with and without failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import connected_model, load_reference, running_swarm

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow, and say which one you like best."]


@pytest.fixture(scope="module")
def reference(smollm_dir: Path) -> torch.nn.Module:
    return load_reference(smollm_dir)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> AutoTokenizer:
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    tokenizer.padding_side = "left"
    return tokenizer


def chat_inputs(tokenizer: AutoTokenizer, questions: list[str]) -> dict[str, torch.Tensor]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))


def local_generate(reference: torch.nn.Module, inputs: dict, **kwargs: object) -> torch.Tensor:
    with torch.inference_mode():
        return reference.generate(**inputs, **kwargs)


@pytest.fixture(scope="module")
def two_servers(smollm_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(smollm_dir, [(0, 15), (15, 30)]) as swarm:
        yield swarm


def test_greedy_64_tokens_equal_local_token_for_token(smollm_dir, reference, tokenizer, two_servers) -> None:
    inputs = chat_inputs(tokenizer, QUESTIONS[:1])
    expected = local_generate(reference, inputs, max_new_tokens=64, do_sample=False)
    with connected_model(smollm_dir, two_servers) as model:
        output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    assert output.tolist() == expected.tolist()
    assert "Paris" in tokenizer.decode(output[0])


def test_a_batch_of_padded_prompts_equals_local(smollm_dir, reference, tokenizer, two_servers) -> None:
    inputs = chat_inputs(tokenizer, QUESTIONS)
    assert not inputs["attention_mask"].all()  # the prompts differ in length: the batch is left-padded
    expected = local_generate(reference, inputs, max_new_tokens=24, do_sample=False)
    with connected_model(smollm_dir, two_servers) as model:
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert output.tolist() == expected.tolist()


def test_sampling_with_a_seed_equals_local_sampling(smollm_dir, reference, tokenizer, two_servers) -> None:
    inputs = chat_inputs(tokenizer, QUESTIONS[1:])
    options = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)
    torch.manual_seed(7)
    expected = local_generate(reference, inputs, **options)
    with connected_model(smollm_dir, two_servers) as model:
        torch.manual_seed(7)
        output = model.generate(**inputs, **options)
    assert output.tolist() == expected.tolist()


def test_beam_search_equals_local_beam_search(smollm_dir, reference, tokenizer, two_servers) -> None:
    inputs = chat_inputs(tokenizer, QUESTIONS[:1])
    expected = local_generate(reference, inputs, max_new_tokens=16, num_beams=3, do_sample=False)
    with connected_model(smollm_dir, two_servers) as model:
        output = model.generate(**inputs, max_new_tokens=16, num_beams=3, do_sample=False)
    assert output.tolist() == expected.tolist()


def test_a_session_continues_across_generate_calls(smollm_dir, reference, tokenizer, two_servers) -> None:
    inputs = chat_inputs(tokenizer, QUESTIONS[1:])
    expected = local_generate(reference, inputs, max_new_tokens=20, do_sample=False)
    with connected_model(smollm_dir, two_servers) as model, model.inference_session(max_length=128) as session:
        first = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        fed = session.position
        second = model.generate(first, max_new_tokens=12, do_sample=False)
        # the second call sent only what the session had not seen: the first call's last token, then all new ones
        # but the last
        assert session.position == fed + second.shape[1] - first.shape[1]
    assert second.tolist() == expected.tolist()


def test_greedy_through_three_servers_equals_local(smollm_dir, reference, tokenizer) -> None:
    inputs = chat_inputs(tokenizer, QUESTIONS[:1])
    expected = local_generate(reference, inputs, max_new_tokens=64, do_sample=False)
    with (
        running_swarm(smollm_dir, [(0, 10), (10, 20), (20, 30)]) as swarm,
        connected_model(smollm_dir, swarm) as model,
    ):
        output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    assert output.tolist() == expected.tolist()


class KillAfterTokens:
    """A streamer that SIGKILLs the server serving `block` once `count` new tokens have been generated."""

    def __init__(self, model: torch.nn.Module, swarm: LocalSwarm, plan: list[tuple[int, int]]):
        self.model, self.swarm, self.plan, self.generated, self.killed = model, swarm, list(plan), -1, []

    def put(self, value: torch.Tensor) -> None:
        self.generated += 1  # the first call carries the prompt
        while self.plan and self.plan[0][0] == self.generated:
            _, block = self.plan.pop(0)
            self.killed.append(kill_server_of(self.model, self.swarm, block))

    def end(self) -> None:
        pass


def kill_server_of(model: torch.nn.Module, swarm: LocalSwarm, block: int, session: object = None) -> str:
    """SIGKILL the server that an open inference session (by default the model's active one in this thread) uses
    for `block`; return its peer id."""
    session = session or model.active_session
    peer = next(s.peer_id for s in session.route if s.start <= block < s.end)
    swarm.kill(next(server for server in swarm.servers if server.peer_id == peer))
    return peer


def test_sigkill_mid_prefill_and_mid_decode_changes_nothing(smollm_dir, reference, tokenizer) -> None:
    question = "Summarize in one sentence: " + " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
    inputs = chat_inputs(tokenizer, [question])
    expected = local_generate(reference, inputs, max_new_tokens=24, do_sample=False)
    spans = [(0, 15), (0, 15), (0, 15), (15, 30), (15, 30)]
    with running_swarm(smollm_dir, spans) as swarm, connected_model(smollm_dir, swarm) as model:
        manager = model.model.layers.client.manager

        # the session is opened here, so that the killer thread can watch it (sessions in `with` are per thread)
        session = model.inference_session(max_length=inputs["input_ids"].shape[1] + 24)

        def kill_when_open() -> None:
            # the long prompt's prefill keeps the first span busy: its successor dies before the prefill reaches it
            deadline = time.monotonic() + 120
            while not session.route and time.monotonic() < deadline:
                time.sleep(0.005)
            killed.append(kill_server_of(model, swarm, 15, session))

        killed: list[str] = []
        killer = threading.Thread(target=kill_when_open)
        killer.start()
        with session:
            output = model.generate(**inputs, max_new_tokens=24, do_sample=False, session=session)
        killer.join(timeout=150)
        assert output.tolist() == expected.tolist()
        assert manager.health.failed(killed[0])  # the prefill met the dead server and was recovered

        # then two servers, one after another, while decoding
        streamer = KillAfterTokens(model, swarm, [(4, 0), (10, 0)])  # the 0:15 server, then its replacement
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False, streamer=streamer)
        assert output.tolist() == expected.tolist()
        assert len(streamer.killed) == 2 and all(manager.health.failed(peer) for peer in streamer.killed)
