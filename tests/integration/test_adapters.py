"""LoRA adapters served by real `swarmlm serve --adapters` processes: a client naming an adapter routes only through
servers that announce it and gets what the local PEFT model gives; a client naming none gets the base model even
from servers that hold adapters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.errors import MissingAdapterError, MissingBlocksError
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference
from tests.integration.test_backward_tiny import assert_close, gradients
from tests.tiny_families import build_adapter, build_tiny, load_peft_reference

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model_dir = build_tiny("llama", root / "model")
    return {
        "model": model_dir,
        "everywhere": build_adapter(model_dir, root / "everywhere", seed=1),
        "some-blocks": build_adapter(model_dir, root / "some-blocks", seed=2, layers_to_transform=[1, 2]),
    }


@pytest.fixture(scope="module")
def swarm(folders: dict[str, Path]) -> Iterator[LocalSwarm]:
    """Blocks 0:2 and 2:4 with both adapters, and a plain 2:4 server that a client with an adapter must avoid."""
    adapters = ["--adapters", str(folders["everywhere"]), str(folders["some-blocks"])]
    swarm = LocalSwarm(str(folders["model"]), threads_per_server=1)
    try:
        started = [
            swarm.add_server(0, 2, wait=False, extra_args=adapters),
            swarm.add_server(2, 4, wait=False, extra_args=adapters),
            swarm.add_server(2, 4, wait=False),
        ]
        swarm.wait_ready(started)
        yield swarm
    finally:
        swarm.close()


def ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(seed))


def assert_base_model_through_adapter_servers(folders: dict[str, Path], swarm: LocalSwarm) -> torch.nn.Module:
    """Logits and greedy generation naming no adapter, through the servers holding adapters, equal the base model's;
    returns the local base model."""
    reference = load_reference(folders["model"])
    inputs = ids(2)
    with torch.inference_mode():
        expected = reference(inputs).logits
        generated = reference.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    with connected_model(folders["model"], swarm, allowed_servers=adapter_holders(swarm)) as model:
        with torch.inference_mode():
            logits = model(inputs).logits
        output = model.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL
    assert output.tolist() == generated.tolist()
    return reference


def adapter_holders(swarm: LocalSwarm) -> tuple[str, str]:
    return swarm.servers[0].peer_id, swarm.servers[1].peer_id


def test_a_fresh_adapter_servers_first_base_requests_are_the_base_model(folders, swarm) -> None:
    # first in this module on purpose: the servers are fresh, no request has named an adapter yet (a fresh server
    # once applied its last loaded adapter to requests naming none until some request named one)
    reference = assert_base_model_through_adapter_servers(folders, swarm)
    # deep prompt gradients of the base model through the same adapter servers
    weights = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(6))
    options = dict(tuning_mode="deep_ptune", pre_seq_len=2, allowed_servers=adapter_holders(swarm))
    with connected_model(folders["model"], swarm, **options) as tuned:
        torch.manual_seed(1)
        with torch.no_grad():
            tuned.prompt_tuning.deep_prompts.normal_(std=0.5)
        remote, local = gradients(tuned, reference.requires_grad_(False), ids(2), weights)
    for actual, wanted in zip(remote, local, strict=True):
        assert_close(actual, wanted)


@pytest.mark.parametrize("adapter", ["everywhere", "some-blocks"])
def test_logits_with_an_adapter_equal_the_local_peft_model(folders, swarm, adapter: str) -> None:
    reference = load_peft_reference(folders["model"], folders[adapter])
    inputs = ids(0)
    with torch.inference_mode():
        expected = reference(inputs).logits
        with reference.disable_adapter():
            base = reference(inputs).logits
    assert (expected - base).abs().max().item() > 1e-2  # the adapter matters
    with connected_model(folders["model"], swarm, active_adapter=adapter) as model:
        manager = model.model.layers.client.manager
        # the plain server is not in the client's view; the others announce both adapters
        assert set(manager.servers) == {swarm.servers[0].peer_id, swarm.servers[1].peer_id}
        assert all(record.adapters == ("everywhere", "some-blocks") for record in manager.servers.values())
        assert model.server_info(swarm.servers[0].peer_id).adapters == ("everywhere", "some-blocks")
        with torch.inference_mode():
            logits = model(inputs).logits
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


def test_greedy_generation_with_an_adapter_equals_local_peft(folders, swarm) -> None:
    reference = load_peft_reference(folders["model"], folders["some-blocks"])
    inputs = ids(1)
    with torch.inference_mode():
        expected = reference.generate(input_ids=inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    with connected_model(folders["model"], swarm, active_adapter="some-blocks") as model:
        output = model.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert output.tolist() == expected.tolist()


def test_deep_prompt_gradients_through_an_adapter_equal_local_peft(folders, swarm) -> None:
    # the causal LM inside the PEFT model: its blocks carry the adapter, as the servers' do
    reference = load_peft_reference(folders["model"], folders["everywhere"]).base_model.model.requires_grad_(False)
    inputs = ids(4)
    weights = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(5))
    options = dict(active_adapter="everywhere", tuning_mode="deep_ptune", pre_seq_len=2)
    with connected_model(folders["model"], swarm, **options) as tuned:
        torch.manual_seed(0)
        with torch.no_grad():
            tuned.prompt_tuning.deep_prompts.normal_(std=0.5)
        remote, local = gradients(tuned, reference, inputs, weights)
    for actual, expected in zip(remote, local, strict=True):
        assert_close(actual, expected)


def test_base_requests_after_adapter_requests_are_the_base_model(folders, swarm) -> None:
    assert_base_model_through_adapter_servers(folders, swarm)


def test_an_adapter_no_server_has_fails_at_once_naming_it(folders, swarm) -> None:
    # the servers of every block answer, none holds the adapter: waiting for missing blocks cannot help, so the
    # error comes at once (well within the 60 s the client would otherwise wait) and says which adapters are held
    options = dict(active_adapter="nowhere", missing_blocks_timeout_s=60.0)
    with connected_model(folders["model"], swarm, **options) as model:
        for run in (lambda: model(ids(3)), lambda: model.generate(ids(3), max_new_tokens=2)):
            began = time.monotonic()
            with pytest.raises(MissingAdapterError) as refused:
                run()
            assert time.monotonic() - began < 5.0
            assert isinstance(refused.value, MissingBlocksError)  # callers catching the old error still do
            message = str(refused.value)
            assert "adapter 'nowhere'" in message and "block(s) 0-3" in message
            assert "everywhere, some-blocks" in message and "...none" not in message
            assert "--adapters" in message  # how to serve it


def test_an_adapter_some_blocks_lack_names_those_blocks(folders, swarm) -> None:
    # only the plain server holds blocks 2:4 for this client: an adapter served for 0:2 alone is missing at 2:4
    options = dict(active_adapter="everywhere", missing_blocks_timeout_s=60.0)
    plain = swarm.servers[2].peer_id
    with connected_model(folders["model"], swarm, allowed_servers=(swarm.servers[0].peer_id, plain), **options) as m:
        began = time.monotonic()
        with pytest.raises(MissingAdapterError, match=r"adapter 'everywhere' for block\(s\) 2-3") as refused:
            m(ids(3))
        assert time.monotonic() - began < 5.0
        assert f"...{plain[-6:]} (blocks 2:4): no adapters" in str(refused.value)
