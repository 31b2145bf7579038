"""Models of one checkpoint sharing one connection to a real swarm (from_pretrained's client=): one DHT node and one
event loop in the process, each model with its own tuning and traces, results equal to a model on its own, the
connection closed with the last model, and clear errors for what cannot be shared."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmlm import AutoDistributedModelForCausalLM
from swarmlm.errors import ConfigError
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import build_tiny_llama, connected_model, descendants, load_reference, running_swarm


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, [(0, 3), (3, 5)]) as swarm:
        yield swarm


def _ids(seed: int, batch: int = 1, seq: int = 6) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _pids() -> set[int]:
    return {process.pid for process in descendants()}


def _wait_for_pids(expected: set[int], timeout_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (now := _pids()) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def _prompt_grad(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return model.prompt_tuning.deep_prompts.grad.clone()


def test_a_chat_model_and_a_trainer_share_one_connection(tiny_model_dir: Path, swarm: LocalSwarm) -> None:
    reference = load_reference(tiny_model_dir)
    prompt = _ids(1)
    with torch.inference_mode():
        expected = reference.generate(prompt, max_new_tokens=10, do_sample=False)
    before = _pids()
    with connected_model(tiny_model_dir, swarm) as chat:
        with_one = _pids()
        assert len(with_one) > len(before), "the first model starts the process's DHT node"
        torch.manual_seed(0)
        trainer = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_model_dir), client=chat.client, tuning_mode="deep_ptune", pre_seq_len=3
        )
        try:
            assert _pids() == with_one, "a model sharing the connection starts no DHT node of its own"
            assert trainer.client.manager is chat.client.manager and trainer.client.loop is chat.client.loop
            assert trainer.client.config is chat.client.config  # the options the first model was given

            outputs: list[torch.Tensor] = []
            chatting = threading.Thread(
                target=lambda: outputs.append(chat.generate(prompt, max_new_tokens=10, do_sample=False))
            )
            chatting.start()  # chat decodes while the trainer runs its forward and backward on the same loop
            train_ids = _ids(2, batch=2, seq=12)
            shared_grad = _prompt_grad(trainer, train_ids)
            chatting.join(timeout=120)
            assert outputs and torch.equal(outputs[0], expected)
            # each model keeps its own trace
            assert trainer.last_trace.kind == "backward"
            assert chat.last_trace.kind == "generate"  # the whole generation, every step of it
            assert shared_grad.abs().sum() > 0

            # the same trainer on a connection of its own computes the same gradient
            torch.manual_seed(0)
            with connected_model(tiny_model_dir, swarm, tuning_mode="deep_ptune", pre_seq_len=3) as alone:
                assert torch.equal(alone.prompt_tuning.deep_prompts, trainer.prompt_tuning.deep_prompts)
                torch.testing.assert_close(_prompt_grad(alone, train_ids), shared_grad, rtol=1e-5, atol=1e-6)
            assert _wait_for_pids(with_one) == with_one
        finally:
            trainer.close()
        # the trainer's close leaves the chat model's connection open
        assert not chat.client.connection.closed
        assert torch.equal(chat.generate(prompt, max_new_tokens=10, do_sample=False), expected)
    connection = chat.client.connection
    assert connection.closed and not connection.loop._thread.is_alive()
    assert _wait_for_pids(before) == before, "the shared DHT node stops with the last model"


def test_the_connection_outlives_the_model_that_made_it(tiny_model_dir: Path, swarm: LocalSwarm) -> None:
    reference = load_reference(tiny_model_dir)
    prompt = _ids(3, batch=2)
    with torch.inference_mode():
        expected = reference(prompt).logits
    with connected_model(tiny_model_dir, swarm) as first:
        second = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_model_dir), client=first.client)
    try:
        with torch.inference_mode():
            torch.testing.assert_close(second(prompt).logits, expected, rtol=0, atol=1e-4)
        with pytest.raises(ConfigError, match="closed"):  # a closed model's client cannot be shared any more
            AutoDistributedModelForCausalLM.from_pretrained(str(tiny_model_dir), client=first.client)
    finally:
        second.close()
    assert second.client.connection.closed


def test_what_cannot_be_shared_is_refused_clearly(tiny_model_dir: Path, swarm: LocalSwarm, tmp_path: Path) -> None:
    other_checkpoint = build_tiny_llama(tmp_path / "other", seed=1)
    before = _pids()
    with connected_model(tiny_model_dir, swarm) as model:
        with_one = _pids()
        load = AutoDistributedModelForCausalLM.from_pretrained
        with pytest.raises(ConfigError, match="initial_peers cannot be combined with client="):
            load(str(tiny_model_dir), client=model.client, initial_peers=swarm.initial_peers)
        with pytest.raises(ConfigError, match="request_timeout_s cannot be combined with client="):
            load(str(tiny_model_dir), client=model.client, request_timeout_s=5.0)
        with pytest.raises(ConfigError, match="another checkpoint"):
            load(str(other_checkpoint), client=model.client)
        with pytest.raises(ConfigError, match="distributed model's .client"):
            load(str(tiny_model_dir), client=model)
        assert _pids() == with_one
        # nothing refused took a share of the connection: it closes with the one model using it
    assert model.client.connection.closed
    assert _wait_for_pids(before) == before


async def _greedy_on_loop(model: Any, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids = prompt
    session = model.inference_session(max_length=prompt.shape[1] + new_tokens)
    try:
        for _ in range(new_tokens):
            token = (await model.anext_logits(session, ids)).argmax(-1)
            ids = torch.cat([ids, token[:, None]], dim=1)
    finally:
        await session.aclose()
    return ids


def test_generations_as_coroutines_on_the_client_loop_equal_generate(tiny_model_dir: Path, swarm: LocalSwarm) -> None:
    """Plain, prompt-tuned and LoRA-tuned models sharing one loop, three generations each as coroutines at once (as
    the API server runs its requests): every one equals generate() of its model, the plain ones local greedy too,
    and every token's LM head went through the loop's batcher."""
    reference = load_reference(tiny_model_dir)
    prompts = [_ids(seed, seq=4 + seed) for seed in (3, 4, 5)]
    with connected_model(tiny_model_dir, swarm) as chat:
        torch.manual_seed(1)
        tuned = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_model_dir), client=chat.client, tuning_mode="deep_ptune", pre_seq_len=2
        )
        lora = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_model_dir), client=chat.client, tuning_mode="lora"
        )
        with torch.no_grad():  # LoRA starts as the identity: weights of its own make its tokens its own
            for parameter in lora.lora_tuning.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)) * 0.5)
        models = (chat, tuned, lora)
        try:

            async def all_at_once() -> list[torch.Tensor]:
                runs = [_greedy_on_loop(model, prompt, 6) for model in models for prompt in prompts]
                return await asyncio.gather(*runs)

            outputs = chat.client.loop.run(all_at_once())
            with torch.inference_mode():
                for model, out in zip([m for m in models for _ in prompts], outputs, strict=True):
                    prompt = out[:, : out.shape[1] - 6]
                    assert torch.equal(out, model.generate(prompt, max_new_tokens=6, do_sample=False))
                for prompt, out in zip(prompts, outputs[:3], strict=True):
                    assert torch.equal(out, reference.generate(prompt, max_new_tokens=6, do_sample=False))
            changed = [not torch.equal(a, b) for a, b in zip(outputs[6:], outputs[:3], strict=True)]
            assert any(changed), "the LoRA weights changed no token: the test would not see them"
            assert [model._loop_heads.rows for model in models] == [3 * 6] * 3
        finally:
            lora.close()
            tuned.close()
