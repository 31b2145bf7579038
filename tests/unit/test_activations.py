"""A server keeps a training forward's graphs for its backward (server/activations.py): the backward from the kept
graphs gives exactly what a recomputed one gives without running the forward again; a backward of other inputs, of
another peer or past the time limit recomputes; what is kept stays within the budget and a host's share of it."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from swarmlm.errors import ProtocolError
from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.messages import PROTOCOL_VERSION, BackwardRequest, ForwardRequest, parse_header
from swarmlm.server.activations import ActivationCache
from swarmlm.server.backend import Keeping, SpanBackend
from swarmlm.server.pieces import BlockGraph
from tests.tiny_families import build_tiny
from tests.unit.test_pieces import BUDGETS, drive, request

KEY = "0123456789abcdef"


@pytest.fixture(scope="module")
def span(tmp_path_factory: pytest.TempPathFactory) -> SpanModel:
    return SpanModel.from_dir(build_tiny("llama", tmp_path_factory.mktemp("llama")), 0, 4)


def run(backend: SpanBackend, inputs: SpanTensors, lora, keeping: Keeping | None, budgets=(0,)):
    (results, _), pieces = drive(backend._run_by_block(0, 4, inputs, None, lora, keeping), list(budgets))
    return results, pieces


@pytest.mark.parametrize("budgets", [[0], BUDGETS], ids=["whole-blocks", "chunks"])
def test_a_backward_from_the_kept_forward_equals_a_recomputed_one_and_skips_the_forward(span, budgets) -> None:
    backend = SpanBackend(span, torch.float32, "cpu", 8192, activations=ActivationCache(1 << 30))
    inputs, lora = request(span, backward=True)
    forward_inputs = replace(inputs, grad_outputs=None)
    expected, recomputed = run(backend, inputs, lora, None, budgets)

    keeping = Keeping("peer-a", "10.0.0.1", KEY)
    (output,), _ = run(backend, forward_inputs, lora, keeping, budgets)
    (plain,), _ = run(backend, forward_inputs, lora, None, budgets)
    assert torch.equal(output, plain)  # keeping the graph changes nothing in the forward's result
    assert len(backend.activations) == 1 and backend.activations.nbytes > 0
    results, pieces = run(backend, inputs, lora, keeping, budgets)
    assert backend.activations.hits == 1 and len(backend.activations) == 0
    assert pieces < recomputed  # the backward's pieces only: no forward ran
    for result, reference in zip(results, expected, strict=True):
        assert torch.equal(result, reference)
    backend.shutdown()


def test_a_backward_that_is_not_the_kept_forwards_recomputes(span) -> None:
    backend = SpanBackend(span, torch.float32, "cpu", 8192, activations=ActivationCache(1 << 30))
    inputs, lora = request(span, backward=True)
    keeping = Keeping("peer-a", "10.0.0.1", KEY)
    other_hidden = replace(inputs, hidden=inputs.hidden + 1)
    expected, recomputed = run(backend, other_hidden, lora, None)
    for backward, keeper in [
        (other_hidden, keeping),  # other inputs under the same id
        (other_hidden, Keeping("peer-b", "10.0.0.1", KEY)),  # another peer naming the same id
    ]:
        run(backend, replace(inputs, grad_outputs=None), lora, keeping)
        results, pieces = run(backend, backward, lora, keeper)
        assert pieces == recomputed
        for result, reference in zip(results, expected, strict=True):
            assert torch.equal(result, reference)
    assert backend.activations.hits == 0 and backend.activations.misses == 2
    backend.shutdown()


def graph(nbytes: int) -> BlockGraph:
    made = BlockGraph(None, None)
    made.storages[id(made)] = nbytes
    return made


def put(cache: ActivationCache, peer: str, key: str, host: str, nbytes: int, hidden: torch.Tensor) -> bool:
    return cache.put(peer, key, host, 0, 1, None, SpanTensors(hidden), [graph(nbytes)])


def test_the_cache_stays_within_its_budget_and_a_hosts_share_evicting_the_oldest() -> None:
    now = [0.0]
    cache = ActivationCache(1000, host_share=0.5, ttl_s=60, clock=lambda: now[0])
    x = torch.zeros(1, 1, 4)
    assert not put(cache, "a", KEY, "h1", 501, x)  # more than a host's share: not kept
    assert put(cache, "a", "1" * 16, "h1", 300, x) and put(cache, "a", "2" * 16, "h1", 200, x)
    assert put(cache, "b", "3" * 16, "h2", 400, x)
    # host h1 is at its share (500): its own oldest goes, not host h2's
    assert put(cache, "c", "4" * 16, "h1", 250, x)
    assert cache.take("a", "1" * 16, 0, 1, None, SpanTensors(x)) is None
    assert cache.host_bytes("h1") == 450 and cache.host_bytes("h2") == 400 and cache.nbytes == 850
    # the whole budget is full: the oldest of all goes (h1's 200, then h2's 400)
    assert put(cache, "d", "5" * 16, "h3", 500, x)
    assert cache.nbytes <= 1000 and cache.host_bytes("h3") == 500
    assert cache.take("b", "3" * 16, 0, 1, None, SpanTensors(x)) is None
    assert cache.take("c", "4" * 16, 0, 1, None, SpanTensors(x)) is not None  # taken once
    assert cache.take("c", "4" * 16, 0, 1, None, SpanTensors(x)) is None
    # what waits longer than the time limit is dropped
    now[0] = 61.0
    assert cache.take("d", "5" * 16, 0, 1, None, SpanTensors(x)) is None and cache.nbytes == 0


def test_a_kept_graph_is_only_the_span_adapter_and_inputs_it_was_made_for() -> None:
    cache = ActivationCache(1000)
    x = torch.arange(4.0).reshape(1, 1, 4)
    mask = torch.ones(1, 1, dtype=torch.long)
    for start, end, adapter, inputs in [
        (0, 2, None, SpanTensors(x)),  # another span
        (0, 1, "other", SpanTensors(x)),  # another adapter
        (0, 1, None, SpanTensors(x.double())),  # another dtype
        (0, 1, None, SpanTensors(x, attention_mask=mask)),  # a mask the forward did not have
    ]:
        assert put(cache, "a", KEY, "h", 10, x)
        assert cache.take("a", KEY, start, end, adapter, inputs) is None
    assert put(cache, "a", KEY, "h", 10, x)
    assert cache.take("a", KEY, 0, 1, None, SpanTensors(x.clone())) is not None


def test_the_graphs_size_counts_activations_not_the_frozen_weights(span) -> None:
    backend = SpanBackend(span, torch.float32, "cpu", 8192, activations=ActivationCache(1 << 30))
    inputs, lora = request(span, backward=False)
    run(backend, inputs, None, Keeping("a", "h", KEY))
    weights = sum(p.numel() * p.element_size() for p in span.parameters())
    activations = backend.activations.nbytes
    rows, seq = inputs.hidden.shape[:2]
    # at least each block's input and output; far less than the weights of this tiny model would add
    assert 4 * 2 * rows * seq * span.config.hidden_size * 4 <= activations < weights
    backend.shutdown()


@pytest.mark.parametrize(
    "kind, fields",
    [
        (ForwardRequest, {"keep": "not-hex-at-all!"}),
        (ForwardRequest, {"keep": "ab"}),  # too short to be a random id
        (ForwardRequest, {"keep": "a" * 33}),
        (BackwardRequest, {"kept": "XYZ"}),
        (BackwardRequest, {"keep": KEY}),  # a backward keeps nothing
    ],
)
def test_malformed_keep_ids_are_refused_as_bad_requests(kind, fields) -> None:
    data = {"kind": kind.model_fields["kind"].default, "start_block": 0, "end_block": 1,
            "protocol_version": PROTOCOL_VERSION, **fields}  # fmt: skip
    with pytest.raises(ProtocolError):
        parse_header(data, kind)
    valid = {name: value for name, value in data.items() if name not in fields}
    valid.update({name: KEY for name in fields if not (name == "keep" and kind is BackwardRequest)})
    parse_header(valid, kind)  # the same request with a well-formed id (or, in a backward, none to keep) is fine


def test_a_server_that_keeps_nothing_runs_a_keeping_forward_as_a_plain_one(span) -> None:
    backend = SpanBackend(span, torch.float32, "cpu", 8192, activations=ActivationCache(0))  # --activation-cache-mb 0
    inputs, lora = request(span, backward=True)
    (output,), pieces = run(backend, replace(inputs, grad_outputs=None), lora, Keeping("a", "h", KEY))
    (plain,), plain_pieces = run(backend, replace(inputs, grad_outputs=None), lora, None)
    assert torch.equal(output, plain) and pieces == plain_pieces
    assert len(backend.activations) == 0 and backend.activations.refused == 0  # no graph was even built
    expected, _ = run(backend, inputs, lora, None)
    results, _ = run(backend, inputs, lora, Keeping("a", "h", KEY))  # its backward recomputes
    for result, reference in zip(results, expected, strict=True):
        assert torch.equal(result, reference)
    backend.shutdown()


def test_a_graph_larger_than_a_hosts_share_is_not_built_in_full_and_smaller_ones_still_are(span) -> None:
    inputs, lora = request(span, backward=False)
    probe = SpanBackend(span, torch.float32, "cpu", 8192, activations=ActivationCache(1 << 30))
    run(probe, inputs, lora, Keeping("a", "h", KEY))
    whole = probe.activations.nbytes  # this request's graphs over its 4 blocks
    # a host may keep about 2.5 blocks' worth: the graph is dropped after the third block, nothing is kept
    backend = SpanBackend(span, torch.float32, "cpu", 8192, activations=ActivationCache(int(whole * 1.25)))
    (output,), _ = run(backend, inputs, lora, Keeping("a", "h", KEY))
    (plain,), _ = run(backend, inputs, lora, None)
    assert torch.equal(output, plain)
    assert len(backend.activations) == 0 and backend.activations.refused == 0  # dropped while running, never offered
    # a request of a quarter the tokens fits (the size learned from the last graph says so) and is kept
    small = inputs.select_rows(0, 1)
    small = replace(small, hidden=small.hidden[:, : small.hidden.shape[1] // 2])
    small = replace(small, attention_mask=None, position_ids=None)
    run(backend, small, lora, Keeping("a", "h", KEY))
    assert len(backend.activations) == 1
    probe.shutdown()
    backend.shutdown()


def graph_tensors() -> int:
    """Tensors alive in this process that are part of an autograd graph (a kept graph's activations and outputs)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("lora_too", [False, True], ids=["plain", "own-lora"])
def test_graphs_evicted_expired_or_taken_are_freed(span, lora_too: bool) -> None:
    """A forward whose backward never comes must not leave memory behind: a graph that leaves the cache frees its
    activations (saved-tensor hooks that referenced the graph, or returned tensors whose grad_fn saved them, kept
    every graph alive through autograd's nodes, where the garbage collector cannot see the cycle)."""
    now = [0.0]
    inputs, lora = request(span, backward=True)
    lora = lora if lora_too else None
    forward = replace(inputs, grad_outputs=None)
    probe = SpanBackend(span, torch.float32, "cpu", 8192, activations=ActivationCache(1 << 30))
    run(probe, forward, lora, Keeping("a", "h", KEY))
    one = probe.activations.nbytes
    probe.shutdown()
    del probe
    before = graph_tensors()
    # room for one graph: each new one evicts the last
    cache = ActivationCache(int(one * 1.5), host_share=1.0, ttl_s=60, clock=lambda: now[0])
    backend = SpanBackend(span, torch.float32, "cpu", 8192, activations=cache)
    for i in range(4):
        run(backend, forward, lora, Keeping("a", "h", f"{i:016x}"))
    assert len(cache) == 1 and cache.evicted == 3
    kept = graph_tensors() - before
    assert kept > 0  # the one graph still kept
    run(backend, forward, lora, Keeping("a", "h", f"{9:016x}"))
    assert graph_tensors() - before == kept  # one more evicted: nothing more alive
    now[0] = 61.0
    assert cache.expire() == 1 and len(cache) == 0
    assert graph_tensors() == before  # expired: freed
    run(backend, forward, lora, Keeping("a", "h", KEY))
    run(backend, inputs, lora, Keeping("a", "h", KEY))  # its backward takes it
    assert cache.hits == 1 and graph_tensors() == before
    backend.shutdown()
