"""After a refusal the server drops what the peer sends on, within a time and a byte bound; no sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarmlm.net import transport


def test_a_refused_peer_that_keeps_sending_is_cut_off_at_the_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAX_DRAIN_BYTES", 1 << 20)

    async def main() -> int:
        reader = asyncio.StreamReader(limit=1 << 22)
        reader.feed_data(bytes(4 << 20))  # more than the bound, and no end
        await transport._drain(reader)
        reader.feed_eof()
        return len(await reader.read())  # what the drain left unread

    left = asyncio.run(main())
    assert 0 < left <= (3 << 20)


def test_a_refused_peer_that_neither_sends_nor_closes_is_cut_off_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "CLOSE_LINGER_S", 0.2)

    async def main() -> float:
        reader = asyncio.StreamReader()
        reader.feed_data(b"some")
        began = time.monotonic()
        await transport._drain(reader)
        return time.monotonic() - began

    assert 0.15 <= asyncio.run(main()) < 1.0


def test_a_refused_peer_that_closes_ends_the_drain_at_once() -> None:
    async def main() -> float:
        reader = asyncio.StreamReader()
        reader.feed_data(b"the rest of a request")
        reader.feed_eof()
        began = time.monotonic()
        await transport._drain(reader)
        return time.monotonic() - began

    assert asyncio.run(main()) < 0.1
