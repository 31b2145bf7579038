"""Servers started with `--dtype auto` compute in the checkpoint's own dtype and announce it (bfloat16 or float32, as
its config.json says; float32 for a converted GGUF), and an inference session reserves KV cache only at the blocks it
uses (Petals' server-info case: 100 tokens over blocks 2:5 of a server holding 2:7 take 300 block-tokens)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmlm.models.loading import load_config
from swarmlm.models.span import SpanModel
from swarmlm.server.server import serving_dtype
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import build_tiny_llama, connected_model, running_swarm

HIDDEN_SIZE = 64
CACHE_TOKENS = 1000  # --cache-tokens: room for this many tokens at each block a server holds
AUTO = ["--dtype", "auto"]
# bfloat16 keeps 8 significant bits: results computed in it agree to about one part in 2**7 of their scale
BF16_RTOL = 2**-7
FP32_ATOL = 1e-4
# the server frees a closed session's cache when it sees the stream end, soon after the client closes it
RELEASE_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved in bfloat16 (its config.json says "dtype": "bfloat16")."""
    source = build_tiny_llama(tmp_path_factory.mktemp("tiny-source"), num_layers=4)
    folder = tmp_path_factory.mktemp("tiny-bf16")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-fp32"), num_layers=7)


@pytest.fixture(scope="module")
def bf16_swarm(bf16_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(bf16_dir, [(0, 4)], extra_args=AUTO) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def fp32_swarm(fp32_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(fp32_dir, [(2, 7)], extra_args=[*AUTO, "--cache-tokens", str(CACHE_TOKENS)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def fp32_model(fp32_dir: Path, fp32_swarm: LocalSwarm) -> Iterator[torch.nn.Module]:
    with connected_model(fp32_dir, fp32_swarm) as model:
        yield model


def hidden_states(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, length, HIDDEN_SIZE, generator=torch.Generator().manual_seed(seed))


def announced_dtype(model: torch.nn.Module, peer: str) -> tuple[str, str]:
    """The server's dtype as its DHT record and its rpc_info say."""
    manager = model.model.layers.client.manager
    return manager.view.servers[peer].dtype, model.server_info(peer).dtype


def test_a_bfloat16_checkpoint_is_served_in_bfloat16(bf16_dir: Path, bf16_swarm: LocalSwarm) -> None:
    hidden = hidden_states(2, 9, seed=0)
    with connected_model(bf16_dir, bf16_swarm) as model:  # the client's own parts in float32, its default
        with torch.inference_mode():
            out = model.model.layers(hidden)
        assert announced_dtype(model, bf16_swarm.servers[0].peer_id) == ("bfloat16", "bfloat16")
    with torch.inference_mode():
        expected = SpanModel.from_dir(bf16_dir, 0, 4, torch.bfloat16)(hidden.to(torch.bfloat16)).float()
    # sent and answered in float32, computed in bfloat16: every value of the answer is a bfloat16 value
    assert out.dtype == torch.float32 and torch.equal(out, out.to(torch.bfloat16).float())
    assert (out - expected).abs().max().item() <= BF16_RTOL * expected.abs().max().item()


def test_a_float32_checkpoint_is_served_in_float32(fp32_dir: Path, fp32_swarm: LocalSwarm, fp32_model) -> None:
    hidden = hidden_states(2, 9, seed=1)
    with torch.inference_mode():
        out = fp32_model.model.layers[2:7](hidden)
        expected = SpanModel.from_dir(fp32_dir, 2, 7)(hidden)
    assert announced_dtype(fp32_model, fp32_swarm.servers[0].peer_id) == ("float32", "float32")
    assert (out - expected).abs().max().item() <= FP32_ATOL


def test_a_converted_gguf_is_served_in_float32(smollm_dir: Path) -> None:
    """A GGUF file is dequantized to float32 on conversion, and the converted folder's config.json says so."""
    assert json.loads((smollm_dir / "config.json").read_text())["dtype"] == "float32"
    assert serving_dtype("auto", load_config(smollm_dir)) == "float32"


def free_cache(model: torch.nn.Module, peer: str) -> int:
    return model.server_info(peer).cache_tokens_left


def test_a_session_reserves_cache_only_at_the_blocks_it_uses(fp32_swarm: LocalSwarm, fp32_model) -> None:
    peer = fp32_swarm.servers[0].peer_id
    info = fp32_model.server_info(peer)
    assert info.cache_tokens_total == CACHE_TOKENS * 5  # block-tokens: CACHE_TOKENS at each of blocks 2:7
    before = free_cache(fp32_model, peer)
    assert before == info.cache_tokens_total
    with fp32_model.model.layers[2:5].inference_session(max_length=100) as session:
        session.step(hidden_states(1, 1, seed=2))
        inside = free_cache(fp32_model, peer)
        with fp32_model.model.layers[6:7].inference_session(max_length=50) as other:
            other.step(hidden_states(1, 1, seed=3))
            inside_both = free_cache(fp32_model, peer)
    assert before - inside == 100 * 3  # 100 tokens at blocks 2, 3 and 4; none at 5 and 6
    assert inside - inside_both == 50 * 1
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while free_cache(fp32_model, peer) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free_cache(fp32_model, peer) == before
