"""Forward through real local swarms of a tiny random Llama: exactness, routing, sub-batches, missing blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmlm.client.remote_sequential import split_batch
from swarmlm.errors import MissingBlocksError
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


@pytest.mark.parametrize("spans", [[(0, 2), (2, 5)], [(0, 1), (1, 4), (4, 5)]], ids=["2-servers", "3-servers"])
def test_logits_equal_local(tiny_model_dir: Path, reference: torch.nn.Module, spans: list) -> None:
    ids = torch.randint(0, 128, (3, 21), generator=torch.Generator().manual_seed(1))
    with running_swarm(tiny_model_dir, spans) as swarm, connected_model(tiny_model_dir, swarm) as model:
        logits = model(ids).logits
        with torch.inference_mode():
            expected = reference(ids).logits
        assert (logits - expected).abs().max().item() <= LOGITS_ATOL
        # the route really went through every server
        assert {(s.start, s.end) for s in model.model.layers.client.manager.servers.values()} == set(spans)


@pytest.fixture(scope="module")
def overlapping_swarm(tiny_model_dir: Path):
    # overlapping spans and a replica: many routes exist, each must apply every block exactly once
    with running_swarm(tiny_model_dir, [(0, 3), (2, 5), (1, 5), (0, 3)]) as swarm:
        yield swarm


def test_overlapping_spans_and_replicas_apply_each_block_once(
    tiny_model_dir: Path, reference: torch.nn.Module, overlapping_swarm
) -> None:
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = reference(ids).logits
    with connected_model(tiny_model_dir, overlapping_swarm) as model:
        for _ in range(6):  # routes are picked with random tie-breaking: several calls take several routes
            assert (model(ids).logits - expected).abs().max().item() <= LOGITS_ATOL


def test_slices_run_their_own_blocks(tiny_model_dir: Path, reference: torch.nn.Module, overlapping_swarm) -> None:
    hidden = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7).unsqueeze(0).expand(2, -1)
    with torch.inference_mode():
        expected = hidden
        rotary = reference.model.rotary_emb(hidden, positions)
        for layer in reference.model.layers[1:4]:
            expected = layer(expected, position_embeddings=rotary, position_ids=positions)
    with connected_model(tiny_model_dir, overlapping_swarm) as model:
        blocks = model.model.layers
        assert len(blocks) == 5 and len(blocks[1:4]) == 3 and len(blocks[-1]) == 1
        assert (blocks[1:4](hidden) - expected).abs().max().item() <= LOGITS_ATOL
        with pytest.raises(IndexError):
            blocks[::2]


def test_padding_mask_and_positions_match_local(
    tiny_model_dir: Path, reference: torch.nn.Module, overlapping_swarm
) -> None:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[0, :3] = 0  # left padding of the first row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask, position_ids=positions).logits
    with connected_model(tiny_model_dir, overlapping_swarm) as model:
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    # padded positions attend to nothing: compare the real tokens only
    real = mask.bool()
    assert (logits[real] - expected[real]).abs().max().item() <= LOGITS_ATOL


def test_big_batches_split_into_concurrent_sub_batches(
    tiny_model_dir: Path, reference: torch.nn.Module, overlapping_swarm
) -> None:
    ids = torch.randint(0, 128, (7, 10), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = reference(ids).logits
    with connected_model(tiny_model_dir, overlapping_swarm, max_tokens_per_request=20) as model:
        assert split_batch(7, 10, 20) == [(0, 2), (2, 4), (4, 6), (6, 7)]
        logits = model(ids).logits
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL


def test_split_batch_bounds_tokens() -> None:
    assert split_batch(8, 128, 1024) == [(0, 8)]
    assert split_batch(8, 128, 256) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_batch(3, 2000, 1024) == [(0, 1), (1, 2), (2, 3)]  # one over-long row still travels alone


def test_missing_blocks_error_names_the_blocks(tiny_model_dir: Path) -> None:
    with running_swarm(tiny_model_dir, [(0, 2)]) as swarm:
        with connected_model(tiny_model_dir, swarm, missing_blocks_timeout_s=1.0) as model:
            with pytest.raises(MissingBlocksError) as info:
                model(torch.zeros(1, 4, dtype=torch.int64))
    assert info.value.missing == [2, 3, 4]
    assert "2-4" in str(info.value)
