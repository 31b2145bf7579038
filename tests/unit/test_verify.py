"""Unit tests of spot checks without sockets: when to check, what agrees, who is in the minority, norm bounds."""

import asyncio
import random

import pytest
import torch

from swarmlm.client import trace
from swarmlm.client.verify import (
    MIN_NORM_SAMPLES,
    Opinion,
    UnverifiedResultError,
    Verifier,
    agree,
    relative_difference,
    settle,
)

HIDDEN = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))


def _opinion(peers: tuple[str, ...], output: torch.Tensor, dtype: str = "float32") -> Opinion:
    return Opinion(peers, (dtype,) * len(peers), output)


def test_relative_difference_is_per_token_and_scale_free() -> None:
    assert relative_difference(HIDDEN, HIDDEN.clone()) == 0.0
    assert relative_difference(HIDDEN * 1000, HIDDEN * 1000 * 1.01) == pytest.approx(0.01 / 1.01, rel=1e-3)
    one_token = HIDDEN.clone()
    one_token[1, 3] *= 1.05  # one token of ten perturbed is as visible as all of them
    assert relative_difference(one_token, HIDDEN) == pytest.approx(0.05 / 1.05, rel=1e-3)
    assert relative_difference(HIDDEN[:, :4], HIDDEN) == float("inf")


def test_tolerance_follows_the_coarsest_dtype() -> None:
    close = HIDDEN * (1 + 5e-3)  # beyond float32's tolerance, within half types'
    assert not agree(_opinion(("a",), close), _opinion(("b",), HIDDEN))
    assert agree(_opinion(("a",), close, "bfloat16"), _opinion(("b",), HIDDEN))
    assert agree(_opinion(("a",), HIDDEN + 1e-7), _opinion(("b",), HIDDEN))


def test_a_narrow_wire_widens_the_tolerance_as_its_rounding_does() -> None:
    def on(wire: str, peers: tuple[str, ...], output: torch.Tensor) -> Opinion:
        return Opinion(peers, ("float32",) * len(peers), output, wire)

    # rounded at a hop boundary inside one route: as a 16-bit dtype's results differ
    rounded = HIDDEN * (1 + 5e-3)
    assert not agree(on("float32", ("a",), rounded), on("float32", ("b", "c"), HIDDEN))
    assert agree(on("bfloat16", ("a",), rounded), on("bfloat16", ("b", "c"), HIDDEN))
    # an int8 row of 16 values one rounding step apart in one value: 1/127 of the largest value
    step = HIDDEN.clone()
    step[..., 0] += HIDDEN.abs().amax(dim=-1) / 127
    assert not agree(on("float32", ("a",), step), on("float32", ("b",), HIDDEN))
    assert agree(on("int8", ("a",), step), on("int8", ("b",), HIDDEN))
    assert not agree(on("int8", ("a",), HIDDEN * 1.05), on("int8", ("b",), HIDDEN))


def test_under_an_int8_wire_only_one_server_results_are_compared() -> None:
    """int8 rounding at another hop boundary moves a span's result by far more than a tampering server would (16-49%
    per token on SmolLM2): a result of two servers is no check of one server's, and leaves it unchecked."""
    first = Opinion(("a",), ("float32",), HIDDEN, "int8")
    two_hops = Opinion(("b", "c"), ("float32",) * 2, HIDDEN * 1.3, "int8")
    winner, convicted, avoided = _settle(first, [two_hops])
    assert winner is first and not convicted and len(avoided) == 1
    # nor can it settle a disagreement between two one-server results
    with pytest.raises(UnverifiedResultError, match="no third server"):
        _settle(first, [Opinion(("d",), ("float32",), HIDDEN * 1.1, "int8"), two_hops])
    # under the other wires it is a check like any other
    winner, convicted, _ = _settle(Opinion(("a",), ("float32",), HIDDEN * 1.3, "bfloat16"),
                                   [Opinion(("b", "c"), ("float32",) * 2, HIDDEN, "bfloat16")] * 2)  # fmt: skip
    assert convicted == [("a",)] and torch.equal(winner.output, HIDDEN)


def test_new_servers_are_checked_until_they_pass_then_at_the_configured_rate() -> None:
    verifier = Verifier(probability=0.0, first_requests=2, rng=random.Random(0))
    assert verifier.reason_to_check(("a",), 3, HIDDEN) == "new server"
    verifier.passed(("a",), 3, HIDDEN)
    assert verifier.reason_to_check(("a",), 3, HIDDEN) == "new server"
    verifier.passed(("a",), 3, HIDDEN)
    assert verifier.reason_to_check(("a",), 3, HIDDEN) is None
    verifier.reported.add("a")  # reported by others: checked about half the time
    reasons = [verifier.reason_to_check(("a",), 3, HIDDEN) for _ in range(400)]
    assert 120 < reasons.count("reported") < 280
    sometimes = Verifier(probability=0.1, first_requests=0, rng=random.Random(1))
    assert 20 < sum(sometimes.reason_to_check(("b",), 3, HIDDEN) == "random" for _ in range(500)) < 80


def test_norm_bounds_are_learned_from_verified_replies_only() -> None:
    verifier = Verifier(probability=0.0, first_requests=0)
    assert verifier.norms_plausible(4, HIDDEN * 1e6)  # nothing learned yet: no bound
    for _ in range(MIN_NORM_SAMPLES):
        verifier.passed(("a",), 4, HIDDEN)
    assert verifier.norms_plausible(4, HIDDEN * 2)
    assert not verifier.norms_plausible(4, HIDDEN * 100)
    assert not verifier.norms_plausible(4, HIDDEN / 100)
    assert verifier.norms_plausible(5, HIDDEN * 100)  # another block's bounds are its own
    assert verifier.reason_to_check(("a",), 4, HIDDEN * 100) == "norm out of bounds"


def _settle(first: Opinion, others: list[Opinion | None]) -> tuple[Opinion, list[tuple[str, ...]], list[set[str]]]:
    convicted: list[tuple[str, ...]] = []
    avoided: list[set[str]] = []

    async def rerun(avoid: set[str]) -> Opinion | None:
        avoided.append(set(avoid))
        return others.pop(0)

    async def run() -> Opinion:
        return await trace.traced("forward", settle(Verifier(0.0, 1), first, rerun, lambda p, _: convicted.append(p),
                                                    0, 3, "random"), lambda _: None)  # fmt: skip

    return asyncio.run(run()), convicted, avoided


def test_a_wrong_first_result_loses_to_two_independent_ones() -> None:
    wrong = _opinion(("liar",), HIDDEN * 1.02)
    honest = [_opinion(("b",), HIDDEN), _opinion(("c", "d"), HIDDEN)]
    winner, convicted, avoided = _settle(wrong, honest)
    assert winner.peers == ("b",) and torch.equal(winner.output, HIDDEN)
    assert convicted == [("liar",)]
    assert avoided == [{"liar"}, {"liar", "b"}]  # every opinion comes from servers not in the earlier ones


def test_a_wrong_checker_is_the_one_convicted() -> None:
    first = _opinion(("a",), HIDDEN)
    winner, convicted, _ = _settle(first, [_opinion(("liar",), HIDDEN * 0.9), _opinion(("c",), HIDDEN)])
    assert winner is first and convicted == [("liar",)]


def test_agreement_convicts_nobody_and_no_independent_server_leaves_it_unchecked() -> None:
    first = _opinion(("a",), HIDDEN)
    winner, convicted, avoided = _settle(first, [_opinion(("b",), HIDDEN.clone())])
    assert winner is first and not convicted and len(avoided) == 1
    winner, convicted, _ = _settle(first, [None])
    assert winner is first and not convicted


@pytest.mark.parametrize("third", [None, "disagrees"])
def test_an_unsettled_disagreement_returns_neither_result(third: str | None) -> None:
    first, second = _opinion(("a",), HIDDEN), _opinion(("b",), HIDDEN * 1.1)
    other = None if third is None else _opinion(("c",), HIDDEN * 1.3)
    with pytest.raises(UnverifiedResultError, match="different results"):
        _settle(first, [second, other])


def test_the_trace_records_checks_retries_and_calls() -> None:
    kept: list[trace.RequestTrace] = []

    async def request() -> None:
        trace.record_call("peer-a", 0, 3, "forward", 10.0, 4.0)
        with trace.purpose("check"):
            trace.record_call("peer-b", 0, 3, "forward", 12.0, 5.0)
        trace.record_retry()

    asyncio.run(trace.traced("forward", request(), kept.append))
    (finished,) = kept
    assert [c.kind for c in finished.calls] == ["forward", "check"]
    assert finished.servers == ["peer-a", "peer-b"] and finished.retries == 1
    assert finished.compute_ms == 9.0 and finished.network_ms == 13.0
    assert "retries 1" in finished.summary()
