"""Every supported family served by real `swarmlm serve` processes equals its local Hugging Face model: logits,
greedy generation token for token, deep prompt tuning gradients, LoRA gradients (against local PEFT), and generation
across a server killed mid-way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.models.loading import load_config
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.test_backward_tiny import CHECKS_OFF, assert_close, gradients
from tests.integration.test_lora_training import loss_and_grads
from tests.tiny_families import FAMILIES, WINDOW, build_tiny

# blocks 2:4 have two servers: one of them dies in the failover test, the other takes over
SPANS = [(0, 2), (2, 4), (2, 4)]
PRE_SEQ_LEN = 3
NEW_TOKENS = 3 * WINDOW  # generation runs well past the sliding window
# LoRA targets per family: Phi-3 fuses its attention projections (and its MLP's gate and up) into one Linear each
LORA_TARGETS = {"phi3": ("qkv_proj", "down_proj")}
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def reference(family_dir: Path) -> torch.nn.Module:
    return load_reference(family_dir).requires_grad_(False)


@pytest.fixture(scope="module")
def swarm(family_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(family_dir, SPANS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(family_dir: Path, swarm: LocalSwarm) -> Iterator[torch.nn.Module]:
    with connected_model(family_dir, swarm) as model:
        yield model


def random_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_local(model, reference) -> None:
    ids = random_ids(2, 3 * WINDOW, seed=0)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask).logits
        logits = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (logits[keep] - expected[keep]).abs().max().item() <= LOGITS_ATOL


def test_greedy_generation_equals_local_token_for_token(model, reference) -> None:
    ids = random_ids(2, WINDOW + 2, seed=1)
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    output = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert output.tolist() == expected.tolist()


def test_deep_prompt_tuning_gradients_equal_local(family_dir, swarm, reference) -> None:
    ids = random_ids(2, WINDOW + 3, seed=2)
    weights = torch.randn(2, WINDOW + 3, 128, generator=torch.Generator().manual_seed(3))
    with connected_model(family_dir, swarm, tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN) as tuned:
        torch.manual_seed(0)
        with torch.no_grad():  # non-zero deep prompts, so that they matter
            tuned.prompt_tuning.deep_prompts.normal_(std=0.5)
        remote, local = gradients(tuned, reference, ids, weights)
    for actual, expected in zip(remote, local, strict=True):
        assert_close(actual, expected)


def test_lora_gradients_equal_local_peft(family_dir, swarm) -> None:
    from peft import LoraConfig, get_peft_model

    targets = LORA_TARGETS.get(load_config(family_dir).model_type, DEFAULT_LORA_TARGETS)
    ids = random_ids(2, WINDOW + 3, seed=5)
    labels = ids.clone()
    labels[0, :3] = -100
    options = dict(tuning_mode="lora", lora_rank=4, lora_alpha=8, lora_target_modules=targets)
    with connected_model(family_dir, swarm, **options, **CHECKS_OFF) as tuned:
        torch.manual_seed(0)
        with torch.no_grad():  # PEFT starts B at zero, which would leave A without gradients
            for b in tuned.lora_tuning.lora_B:
                b.normal_(std=0.2)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
        peft = get_peft_model(load_reference(family_dir), config).eval()
        remote, local = loss_and_grads(tuned, peft, ids, labels)
    assert abs(remote[0].item() - local[0].item()) <= 1e-5 * abs(local[0].item())
    for actual, expected in zip(remote[1:], local[1:], strict=True):
        assert_close(actual, expected)


class KillAfter:
    """A generate() streamer that SIGKILLs the server its session uses for block 2 once `count` tokens are out."""

    def __init__(self, model: torch.nn.Module, swarm: LocalSwarm, count: int):
        self.model, self.swarm, self.count, self.seen, self.killed = model, swarm, count, -1, []

    def put(self, value: torch.Tensor) -> None:
        self.seen += 1  # the first call carries the prompt
        if self.seen == self.count:
            session = self.model.active_session
            peer = next(s.peer_id for s in session.route if s.start <= 2 < s.end)
            self.swarm.kill(next(server for server in self.swarm.servers if server.peer_id == peer))
            self.killed.append(peer)

    def end(self) -> None:
        pass


def test_a_server_killed_mid_generation_changes_nothing(model, swarm, reference) -> None:
    """Last for each family: it leaves blocks 2:4 with one server."""
    ids = random_ids(1, WINDOW + 1, seed=4)
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    streamer = KillAfter(model, swarm, count=WINDOW)
    output = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, streamer=streamer)
    assert len(streamer.killed) == 1
    assert model.model.layers.client.manager.health.failed(streamer.killed[0])
    assert output.tolist() == expected.tolist()
