"""Petals' own client tests (full model, chained calls, sessions, rollback) as cases against a real local swarm."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm import AutoDistributedModelForCausalLM
from swarmlm.errors import SessionClosedError
from swarmlm.models.naming import default_dht_prefix
from swarmlm.models.span import SpanModel
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm

NUM_BLOCKS = 5
HIDDEN_SIZE = 64
VOCAB = 128


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, [(0, 2), (2, NUM_BLOCKS)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, swarm: LocalSwarm) -> Iterator[torch.nn.Module]:
    with connected_model(tiny_model_dir, swarm) as model:
        yield model


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def span(tiny_model_dir: Path) -> SpanModel:
    return SpanModel.from_dir(tiny_model_dir, 0, NUM_BLOCKS)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def token_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def local_blocks(span: SpanModel, hidden: torch.Tensor, start: int = 0, end: int = NUM_BLOCKS) -> torch.Tensor:
    with torch.inference_mode():
        return span(hidden, start=start, end=end)


def test_full_model_through_a_session_with_steps_of_varying_length_equals_local(model, reference) -> None:
    ids = token_ids(2, 12, seed=0)
    with torch.inference_mode():
        expected = reference(ids).logits
        embeds = model.model.embed_tokens(ids)
    outputs, position = [], 0
    with model.model.layers.inference_session(max_length=12) as session:
        for length in [3, 0, 1, 4, 0, 1, 3]:  # empty steps anywhere are no-ops
            hidden = session.step(embeds[:, position : position + length])
            assert hidden.shape == (2, length, HIDDEN_SIZE)
            outputs.append(hidden)
            position += length
            assert session.position == position
        with torch.inference_mode():
            logits = model.lm_head(model.model.norm(torch.cat(outputs, dim=1)))
            # a plain forward ignores any open session: it runs the whole sequence
            assert torch.allclose(model(ids).logits, expected, atol=LOGITS_ATOL)
    assert torch.allclose(logits, expected, atol=LOGITS_ATOL), (logits - expected).abs().max()


def test_a_step_longer_than_one_request_runs_in_parts_equal_to_local(
    tiny_model_dir: Path, swarm: LocalSwarm, span: SpanModel
) -> None:
    hidden = randn(2, 11, HIDDEN_SIZE, seed=11)
    mask = torch.ones(2, 11, dtype=torch.int64)
    mask[1, :3] = 0  # a left-padded row: each part must carry the mask up to its own last token
    with torch.inference_mode():
        expected = span(hidden, attention_mask=mask)
    # 8 tokens a request: a prefill of 2 x 11 tokens travels as 3 sub-steps of 2 x 4 tokens at most
    with connected_model(tiny_model_dir, swarm, max_tokens_per_request=8) as small:
        with small.model.layers.inference_session(max_length=12) as session:
            out = session.step(hidden, attention_mask=mask)
            assert session.position == 11
            ones = torch.ones(2, 12, dtype=torch.int64)
            last = session.step(randn(2, 1, HIDDEN_SIZE, seed=12), attention_mask=ones)
    real = mask.bool()
    assert torch.allclose(out[real], expected[real], atol=LOGITS_ATOL), (out - expected)[real].abs().max()
    assert last.shape == (2, 1, HIDDEN_SIZE)


def test_chained_sessions_on_sub_slices_equal_one_session_and_local(model, span) -> None:
    hidden = randn(1, 8, HIDDEN_SIZE, seed=1)
    layers = model.model.layers
    with (
        layers[0:3].inference_session(max_length=8) as first,  # crosses the two servers' spans
        layers[3:NUM_BLOCKS].inference_session(max_length=8) as second,
        layers.inference_session(max_length=8) as whole,
    ):
        for begin, end in [(0, 3), (3, 4), (4, 4), (4, 6), (6, 8)]:
            chained = second.step(first.step(hidden[:, begin:end]))
            direct = whole.step(hidden[:, begin:end])
            expected = local_blocks(span, hidden[:, :end])[:, begin:end]
            assert torch.allclose(chained, expected, atol=LOGITS_ATOL), f"tokens {begin}:{end}"
            assert torch.allclose(direct, expected, atol=LOGITS_ATOL), f"tokens {begin}:{end}"
            middle = first.step(torch.zeros(1, 0, HIDDEN_SIZE))
            assert middle.shape == (1, 0, HIDDEN_SIZE)
        assert first.position == second.position == whole.position == 8


def test_per_sample_deep_prompts_in_a_session_equal_the_forward(model) -> None:
    hidden, prompts = randn(2, 6, HIDDEN_SIZE, seed=2), randn(NUM_BLOCKS, 2, 3, HIDDEN_SIZE, seed=3)
    layers = model.model.layers
    with torch.inference_mode():
        expected = layers(hidden, prompts=prompts)
    with layers.inference_session(max_length=6) as session:
        out = torch.cat([session.step(hidden[:, :2], prompts=prompts), session.step(hidden[:, 2:], prompts)], dim=1)
    assert torch.allclose(out, expected, atol=LOGITS_ATOL)


def test_rollback_via_position_equals_fresh_computation(model, span) -> None:
    hidden, other = randn(2, 8, HIDDEN_SIZE, seed=4), randn(2, 3, HIDDEN_SIZE, seed=5)
    with model.model.layers.inference_session(max_length=12) as session:
        session.step(hidden[:, :4])
        session.step(hidden[:, 4:8])
        session.position = 6  # inside the second step
        out = session.step(other)
        assert session.position == 9
        assert torch.allclose(out, local_blocks(span, torch.cat([hidden[:, :6], other], 1))[:, 6:], atol=LOGITS_ATOL)
        session.position = 2
        assert session.step(hidden[:, :0]).shape == (2, 0, HIDDEN_SIZE)  # carries only the rollback
        out = session.step(other)
        assert torch.allclose(out, local_blocks(span, torch.cat([hidden[:, :2], other], 1))[:, 2:], atol=LOGITS_ATOL)
        with pytest.raises(ValueError, match="position must lie in"):
            session.position = 6
    with pytest.raises(SessionClosedError):
        session.step(other)
    with pytest.raises(SessionClosedError):
        session.position = 0


def local_greedy(reference: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def test_generate_none_continues_the_session(model, reference) -> None:
    ids = token_ids(2, 4, seed=6)
    expected = local_greedy(reference, ids, 8)
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with model.inference_session(max_length=16) as session:
        first = model.generate(ids, **options)  # inside `with`: the session is used
        second = model.generate(None, **options)  # only the new tokens come back, as in Petals
        assert session.position == expected.shape[1] - 1  # the last token was never fed
    assert torch.cat([first, second], dim=1).tolist() == expected.tolist()

    # an explicit session; new inputs that do not repeat its output are appended to it (Petals)
    session = model.inference_session(max_length=24)
    assert model.generate(ids, session=session, **options).tolist() == first.tolist()
    more = token_ids(2, 2, seed=7)
    continued = model.generate(more, session=session, **options)
    session.close()
    assert continued.tolist() == local_greedy(reference, torch.cat([first, more], dim=1), 4)[:, 8:].tolist()
    with pytest.raises(SessionClosedError):
        model.generate(None, session=session, **options)


def test_generate_after_a_rollback_recomputes_from_the_kept_tokens(model, reference) -> None:
    ids = token_ids(1, 5, seed=8)
    options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with model.inference_session(max_length=16) as session:
        model.generate(ids, **options)
        session.position = 3  # keep the first 3 prompt tokens
        output = model.generate(None, **options)
    assert output.tolist() == local_greedy(reference, ids[:, :3], 3)[:, 3:].tolist()


def test_torch_dtype_alias_and_auto_dtype(tiny_model_dir: Path, swarm: LocalSwarm, tmp_path: Path) -> None:
    with connected_model(tiny_model_dir, swarm, torch_dtype=torch.float64) as model:
        assert model.lm_head.weight.dtype == torch.float64
    # "auto" takes the checkpoint's dtype: a bfloat16 copy of the tiny model's client parts
    load_reference(tiny_model_dir).to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        tmp_path, initial_peers=swarm.initial_peers, dht_prefix=default_dht_prefix(str(tiny_model_dir)), dtype="auto"
    )
    with model:  # (a bfloat16 copy has other weights, so another fingerprint: the fp32 swarm does not serve it)
        assert model.lm_head.weight.dtype == torch.bfloat16
    with connected_model(tiny_model_dir, swarm, dtype="auto") as model:
        assert model.lm_head.weight.dtype == torch.float32


def test_threads_sharing_one_model_generate_at_once_each_equal_to_local(model, reference) -> None:
    """Each thread's generate() uses its own session (sessions in `with` blocks are per thread)."""
    prompts = [token_ids(1, 4 + i, seed=20 + i) for i in range(4)]
    results: dict[int, torch.Tensor] = {}

    def work(index: int) -> None:
        with model.inference_session(max_length=16):  # a thread's own `with` session is never another thread's
            results[index] = model.generate(prompts[index], max_new_tokens=6, min_new_tokens=6, do_sample=False)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, ids in enumerate(prompts):
        expected = reference.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert results[index].tolist() == expected.tolist(), index
