"""A request's own LoRA weights: one layout on both sides, hooks that live exactly as long as a block's call, and
requests carrying them never joined with others' nor batched in decode."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers.cache_utils import DynamicCache

from swarmlm.client.lora import LoraTuning, block_shapes
from swarmlm.client.session_links import SpanLink
from swarmlm.errors import ProtocolError
from swarmlm.models.loading import load_config
from swarmlm.models.lora import linear_shapes, lora_applied
from swarmlm.models.registry import get_family
from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import ReplyTensors, SpanTensors
from swarmlm.protocol.lora import LoraSpec, LoraWeights, lora_layout
from swarmlm.server.backend import SpanBackend
from swarmlm.server.joining import JoinableRequest, can_join
from swarmlm.server.validation import SpanLimits, check_lora
from swarmlm.swarm.routing import RouteSpan
from tests.unit.test_scheduler import hold

SPEC = LoraSpec(rank=2, scaling=2.0, targets=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def span(tiny_model_dir: Path) -> SpanModel:
    return SpanModel.from_dir(tiny_model_dir, 0, 5)


def random_lora(span: SpanModel, start: int, end: int, seed: int = 0) -> LoraWeights:
    shapes = [linear_shapes(layer) for layer in span.layers[start:end]]
    layout = lora_layout(shapes, SPEC.rank, SPEC.targets)
    flat = torch.randn(layout.size, generator=torch.Generator().manual_seed(seed)) * 0.3
    return LoraWeights(SPEC, layout, flat, start)


def test_the_layout_follows_the_blocks_modules(span: SpanModel) -> None:
    shapes = [linear_shapes(layer) for layer in span.layers]
    assert shapes[0]["self_attn.q_proj"] == (64, 64) and shapes[0]["self_attn.v_proj"] == (64, 32)
    layout = lora_layout(shapes[:2], 2, ("q_proj", "v_proj"))
    assert layout.modules[0] == (("self_attn.q_proj", 64, 64), ("self_attn.v_proj", 64, 32))
    assert layout.bounds == (0, 448, 896)  # rank 2 * ((64 + 64) + (64 + 32)) per block
    assert lora_layout(shapes[:1], 2, ("self_attn.q_proj",)).size == 256  # a longer name of the same module
    with pytest.raises(ValueError, match="not Linear modules"):
        lora_layout(shapes, 2, ("proj",))  # a target names whole components, as in PEFT
    # the client derives the same layout from blocks on the meta device
    assert block_shapes(span.config, span.family) == shapes


def test_specs_are_bounded() -> None:
    for bad in (dict(rank=0), dict(rank=65), dict(scaling=float("nan")), dict(targets=()),
                dict(targets=("q_proj", "q_proj")), dict(targets=("x; rm",))):  # fmt: skip
        with pytest.raises(ValidationError):
            LoraSpec(**{**SPEC.model_dump(), **bad})


def test_weights_of_some_blocks_are_views_of_the_whole(span: SpanModel) -> None:
    lora = random_lora(span, 0, 5)
    part = lora.blocks(2, 4)
    assert part.first == 2 and part.layout.size == 896
    assert torch.equal(part.flat, lora.flat[896:1792])
    (name, a, b), _ = part.layout.matrices(part.flat, 1)
    assert name == "self_attn.q_proj" and a.shape == (2, 64) and b.shape == (64, 2)
    assert torch.equal(a.reshape(-1), lora.flat[3 * 448 : 3 * 448 + 128])
    with pytest.raises(ValueError, match="outside"):
        part.blocks(1, 3)


def test_hooks_add_the_lora_only_during_the_call_and_go_away_on_error(span: SpanModel) -> None:
    lora = random_lora(span, 0, 5)
    q_proj = span.layers[3].self_attn.q_proj
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        base = q_proj(x)
        with lora_applied(span.layers[3], lora, 3):
            adapted = q_proj(x)
        (_, a, b), _ = lora.layout.matrices(lora.flat, 3)
        assert torch.allclose(adapted, base + F.linear(F.linear(x, a), b) * 2.0, atol=1e-6)
        with pytest.raises(RuntimeError, match="boom"), lora_applied(span.layers[3], lora, 3):
            raise RuntimeError("boom")
        assert not q_proj._forward_hooks and torch.equal(q_proj(x), base)


def test_the_client_starts_like_peft(tiny_model_dir: Path) -> None:
    config = load_config(tiny_model_dir)
    torch.manual_seed(0)
    tuning = LoraTuning(config, get_family(config), "tiny", rank=4, alpha=8, targets=("q_proj",))
    assert len(tuning.lora_A) == 5 and tuning.lora_A[0].shape == (4, 64) and tuning.lora_B[0].shape == (64, 4)
    assert all(not b.any() for b in tuning.lora_B) and all(a.abs().max() <= 0.5 for a in tuning.lora_A)
    assert tuning.spec.scaling == 2.0 and tuning.weights().flat.shape == (5 * 4 * 128,)
    with pytest.raises(ValueError, match="do not fit"):
        LoraTuning(config, get_family(config), "tiny", targets=("nowhere",))


def test_requests_with_lora_run_alone_and_get_their_own_results(span: SpanModel) -> None:
    backend = SpanBackend(span, torch.float32, "cpu", 8192)
    generator = torch.Generator().manual_seed(1)
    inputs = [SpanTensors(torch.randn(1, 4, 64, generator=generator)) for _ in range(3)]
    loras = [random_lora(span, 0, 5, seed) for seed in range(3)]
    release = threading.Event()

    async def main() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        blocker = asyncio.ensure_future(hold(backend.scheduler, release))
        await asyncio.sleep(0.05)  # the compute thread is busy: the requests below wait together
        runs = [asyncio.ensure_future(backend.run(0, 5, x, f"p{i}", lora=lora))
                for i, (x, lora) in enumerate(zip(inputs, loras, strict=True))]  # fmt: skip
        caches = [DynamicCache() for _ in range(3)]
        steps = [
            asyncio.ensure_future(backend.step(cache, 0, 5, SpanTensors(x.hidden[:, :1]), 64, peer=f"s{i}", lora=lora))
            for i, (cache, x, lora) in enumerate(zip(caches, inputs, loras, strict=True))
        ]
        await asyncio.sleep(0.05)
        release.set()
        await blocker
        forwards = [reply.required("hidden") for reply, _ in await asyncio.gather(*runs)]
        decoded = [reply.required("hidden") for reply, _ in await asyncio.gather(*steps)]
        return forwards, decoded

    forwards, decoded = asyncio.run(main())
    assert backend.scheduler.joined_runs == 0 and backend.scheduler.batched_steps == 0
    with torch.inference_mode():
        for x, lora, forward, step in zip(inputs, loras, forwards, decoded, strict=True):
            alone = span(x.hidden, lora=lora)
            assert torch.allclose(forward, alone, atol=1e-5)
            assert torch.allclose(step, alone[:, :1], atol=1e-5)  # a first token sees only itself either way
            assert not torch.allclose(alone, span(x.hidden), atol=1e-3)  # the LoRA weights matter
    backend.shutdown()


def test_the_server_checks_lora_weights_against_its_own_modules(span: SpanModel) -> None:
    limits = SpanLimits(start=0, end=5, hidden_size=64, max_tokens=64, max_position=256, adapters=("a",),
                        linear_shapes=tuple(linear_shapes(layer) for layer in span.layers))  # fmt: skip
    lora = check_lora(SPEC, torch.zeros(2 * 448), 1, 3, limits)
    assert lora is not None and lora.first == 1 and lora.layout.bounds == (0, 448, 896)
    assert check_lora(None, None, 1, 3, limits) is None
    for spec, flat, adapter, message in (
        (SPEC, torch.zeros(448), None, "flat tensor of 896 values"),
        (SPEC, torch.zeros(2 * 448, dtype=torch.int64), None, "float32"),
        (SPEC, None, None, "together with"),
        (None, torch.zeros(896), None, "together with"),
        (SPEC, torch.zeros(896), "a", "not both"),
        (LoraSpec(rank=2, scaling=1.0, targets=("gate",)), torch.zeros(896), None, "do not fit"),
    ):
        with pytest.raises(ProtocolError, match=message):
            check_lora(spec, flat, 1, 3, limits, adapter)


def test_a_session_sends_its_lora_weights_once_per_server(span: SpanModel) -> None:
    session = SpanLink(SimpleNamespace(), RouteSpan("peer", 2, 5), session_start=0)
    sent: list[tuple] = []

    async def exchange(header: object, tensors: list[torch.Tensor], watch: object = ()) -> ReplyTensors:
        sent.append((header, tensors))
        return ReplyTensors(hidden=tensors[0])

    session.stream.exchange = exchange  # type: ignore[method-assign]
    lora, other = random_lora(span, 0, 5, seed=1), random_lora(span, 0, 5, seed=2)
    step = SpanTensors(torch.zeros(1, 1, 64))

    async def steps() -> None:
        for weights in (lora, lora, None, other):
            await session.send(step, lora=weights)

    asyncio.run(steps())
    assert [header.lora is not None for header, _ in sent] == [True, False, False, True]
    assert torch.equal(sent[0][1][-1], lora.blocks(2, 5).flat) and torch.equal(sent[3][1][-1], other.blocks(2, 5).flat)
    assert [len(tensors) for _, tensors in sent] == [2, 1, 1, 2]


def test_bundles_with_lora_weights_never_join() -> None:
    plain = JoinableRequest(0, 5, SpanTensors(torch.zeros(1, 4, 64)))
    with_lora = JoinableRequest(0, 5, SpanTensors(torch.zeros(1, 4, 64), lora=torch.zeros(8)))
    assert can_join(plain, plain)
    assert not can_join(plain, with_lora) and not can_join(with_lora, plain) and not can_join(with_lora, with_lora)


def test_the_train_command_maps_lora_flags_to_from_pretrained_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarmlm.tools.train
    from swarmlm.cli.main import main

    seen: list[swarmlm.tools.train.TrainOptions] = []
    monkeypatch.setattr(swarmlm.tools.train, "run_training", seen.append)
    argv = ["train", "--tuning-mode", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules",
            "q_proj", "o_proj", "--save", "out"]  # fmt: skip
    assert main(argv) == 0
    (options,) = seen
    assert options.lr is None and options.save_dir == "out"
    assert swarmlm.tools.train.tuning_options(options) == dict(
        tuning_mode="lora", lora_rank=4, lora_alpha=8, lora_target_modules=("q_proj", "o_proj")
    )
    assert main(["train"]) == 0
    assert swarmlm.tools.train.tuning_options(seen[1]) == dict(tuning_mode="deep_ptune", pre_seq_len=8)


def test_a_sessions_lora_weights_count_against_its_peers_memory_bound(span: SpanModel) -> None:
    from swarmlm.server.inference import _HeldLora
    from swarmlm.server.peers import LimitError, PeerLedger, PeerLimits

    lora = random_lora(span, 0, 5)  # 5 blocks of 448 float32 values: 8960 bytes
    ledger = PeerLedger(PeerLimits(memory_bytes=12_000, sessions_per_peer=1, sessions_total=1, cache_share=1.0))
    held = _HeldLora(ledger, "peer")

    async def scenario() -> None:
        await held.replace(lora, timeout_s=0.1)
        assert held.weights is lora and ledger.usage("peer").buffered_bytes == 8960
        with pytest.raises(LimitError):  # the old and the new weights together do not fit: the old ones stay
            await held.replace(random_lora(span, 0, 5, seed=1), timeout_s=0.1)
        assert held.weights is lora and ledger.usage("peer").buffered_bytes == 8960
        await held.replace(lora.blocks(0, 1), timeout_s=0.1)
        assert ledger.usage("peer").buffered_bytes == 448 * 4
        held.release()
        assert held.weights is None and ledger.usage("peer").buffered_bytes == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("mode", "options", "named"),
    [
        (None, dict(lora_rank=4), "lora_rank"),
        ("deep_ptune", dict(lora_target_modules=("q_proj",)), "lora_target_modules"),
        ("lora", dict(pre_seq_len=8), "pre_seq_len"),
        (None, dict(pre_seq_len=8), "pre_seq_len"),
    ],
)
def test_options_of_another_tuning_mode_are_refused_not_ignored(mode, options, named) -> None:
    from swarmlm.client.model import AutoDistributedModelForCausalLM

    with pytest.raises(ValueError, match=named):
        # refused before anything is loaded or connected
        AutoDistributedModelForCausalLM.from_pretrained("no-such-model", tuning_mode=mode, **options)


def test_a_long_step_with_lora_weights_in_pieces_equals_one_run(span: SpanModel) -> None:
    """A session step longer than a quantum runs a block at a time (scheduling.Kind.PROMPT) with each block's slice
    of the session's own LoRA weights: its output equals the span's one run with all of them."""
    from swarmlm.models.growing_cache import GrowingCache

    backend = SpanBackend(span, torch.float32, "cpu", 8192)
    lora = random_lora(span, 0, 5, seed=4)
    x = SpanTensors(torch.randn(2, 200, 64, generator=torch.Generator().manual_seed(5)))  # 400 tokens > 256
    assert backend.scheduler.limits.quantum_tokens < 400
    stepped = asyncio.run(backend.step(GrowingCache(), 0, 5, x, 1024, peer="s", lora=lora))[0].required("hidden")
    with torch.inference_mode():
        alone = span(x.hidden, lora=lora)
    assert torch.allclose(stepped, alone, atol=1e-5)
    assert not torch.allclose(alone, span(x.hidden), atol=1e-3)  # the LoRA weights matter
    # with deep prompts too: each block gets its own prompt
    prompts = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(6))
    with_prompts = SpanTensors(x.hidden, prompts=prompts)
    reply, _ = asyncio.run(backend.step(GrowingCache(), 0, 5, with_prompts, 1024, peer="s", lora=lora))
    stepped = reply.required("hidden")
    with torch.inference_mode():
        assert torch.allclose(stepped, span(x.hidden, prompts=prompts, lora=lora), atol=1e-5)
    backend.shutdown()
