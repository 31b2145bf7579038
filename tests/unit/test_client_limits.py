"""The client's pure decisions under announced server limits and bad replies, without sockets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarmlm.client.sequence_manager import SequenceManager, fitting_tokens
from swarmlm.client.span_call import REPLY_SLACK_BYTES, Expected, check_outputs, reply_bytes
from swarmlm.config import ClientConfig
from swarmlm.errors import MissingBlocksError, RemoteCallError


def test_fitting_tokens_is_the_weakest_blocks_best_server() -> None:
    assert fitting_tokens([], 0, 4) is None
    assert fitting_tokens([(0, 4, None)], 0, 4) is None
    # block 2:4 is served by a 64 and a 256 server: 256 fits there; blocks 0:2 only by 128
    assert fitting_tokens([(0, 2, 128), (2, 4, 64), (2, 4, 256)], 0, 4) == 128
    assert fitting_tokens([(0, 2, 128), (2, 4, 64), (2, 4, None)], 0, 4) == 128
    assert fitting_tokens([(0, 2, 128), (2, 4, 64)], 2, 4) == 64


def _manager(limits: dict[str, int | None]) -> SequenceManager:
    manager = SequenceManager(ClientConfig(missing_blocks_timeout_s=0.0), "test", num_blocks=4)
    manager.view.servers = {
        peer: SimpleNamespace(
            start=0,
            end=4,
            throughput=100.0,
            max_tokens_per_request=limit,
            sessions_open=0,
            queue_depth=0.0,
            cache_tokens_left=None,
        )  # type: ignore[misc]
        for peer, limit in limits.items()
    }
    return manager


def test_routes_use_only_servers_whose_announced_limit_fits() -> None:
    manager = _manager({"small": 16, "big": 1024, "silent": None})
    for _ in range(5):
        assert manager.can_route(0, 4, tokens=16, avoid={"big", "silent"})
        assert not manager.can_route(0, 4, tokens=17, avoid={"big", "silent"})
        route = asyncio.run(manager.make_route(0, 4, tokens=100, avoid={"silent"}))
        assert [span.peer_id for span in route] == ["big"]
    with pytest.raises(MissingBlocksError):
        asyncio.run(manager.make_route(0, 4, tokens=2048, avoid={"silent"}))


def test_busy_cool_down_does_not_escalate() -> None:
    manager = _manager({"a": None, "b": None})
    manager.cool_down("a", "busy")
    manager.cool_down("a", "busy")
    assert "a" in manager.health.banned() and not manager.health.failed("a")
    assert [span.peer_id for span in asyncio.run(manager.make_route(0, 4))] == ["b"]
    manager.record_success("a", 0.01)
    assert "a" not in manager.health.banned()


def test_replies_are_bounded_by_their_expected_size() -> None:
    expected = [Expected(torch.Size([2, 3, 64]), torch.float32), Expected(torch.Size([4, 8]), torch.bfloat16)]
    # bf16 may travel widened to float32
    assert reply_bytes(expected) == (2 * 3 * 64 + 4 * 8) * 4 + REPLY_SLACK_BYTES


@pytest.mark.parametrize(
    "outputs",
    [
        [torch.zeros(2, 2, 64)],  # wrong shape
        [torch.zeros(2, 3, 64, dtype=torch.float16)],  # wrong dtype
        [torch.zeros(2, 3, 64), torch.zeros(1)],  # an extra tensor
        [torch.full((2, 3, 64), float("nan"))],
        [torch.full((2, 3, 64), float("-inf"))],
    ],
)
def test_wrong_or_non_finite_replies_are_the_servers_failure(outputs: list[torch.Tensor]) -> None:
    with pytest.raises(RemoteCallError) as info:
        check_outputs(outputs, [Expected(torch.Size([2, 3, 64]), torch.float32)], "rpc_forward", "peer123456")
    assert info.value.peer_id == "peer123456"
    check_outputs([torch.zeros(2, 3, 64)], [Expected(torch.Size([2, 3, 64]), torch.float32)], "rpc_forward", "p")


def test_a_server_whose_record_lapses_keeps_its_dtype_for_spot_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check's tolerance follows the servers' dtypes: a float32 server late to re-announce must not get the
    coarsest one (5%), which would pass its wrong results; a server never seen gets it, and the memory is bounded."""
    manager = SequenceManager(ClientConfig(), "test", num_blocks=4)

    def seen(dtypes: dict[str, str]) -> None:  # a refresh that saw these records, then they all lapsed
        manager.view.servers = {peer: SimpleNamespace(dtype=d) for peer, d in dtypes.items()}  # type: ignore[misc]
        manager._remember_dtypes()
        manager.view.servers = {}

    seen({"a": "float32", "b": "bfloat16"})
    assert [manager.dtype_of(peer) for peer in ("a", "b", "never")] == ["float32", "bfloat16", "unknown"]
    monkeypatch.setattr("swarmlm.client.sequence_manager.MAX_REMEMBERED_DTYPES", 2)
    seen({"b": "bfloat16", "c": "float32"})
    assert [manager.dtype_of(peer) for peer in ("a", "b", "c")] == ["unknown", "bfloat16", "float32"]
