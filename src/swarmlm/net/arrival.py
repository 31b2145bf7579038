"""Deadlines on a message while it arrives: once its first part is in, each further part must follow in time.

A sender that starts a message and stalls holds a stream, a handler and the bytes already read; waiting for it up to
the whole request deadline (a minute) lets a cheap peer hold them long. The wait for a message's first part is the
caller's (an inference session waits between steps for as long as it may stay idle); after it, every part (and the
stream's end, where the caller reads it) has arrival_timeout_s, and a sender that misses it is refused with the error
kind "timeout".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

from swarmlm.errors import LimitError

Part = TypeVar("Part")
# the error kind of a request refused because it stopped arriving (protocol.messages.ReplyHeader)
TIMEOUT_KIND = "timeout"


def arrival_timeout(what: str, timeout_s: float) -> LimitError:
    """The refusal of a message (or frame) whose next bytes did not come within timeout_s."""
    return LimitError(f"{what} stopped arriving: nothing more came for {timeout_s:g} s", TIMEOUT_KIND)


async def arriving(parts: AsyncIterator[Part], timeout_s: float) -> AsyncGenerator[Part, None]:
    """The parts of `parts` for reading one message: the first whenever it comes, each later one within timeout_s of
    the one before (LimitError of kind "timeout" otherwise). Closing this iterator leaves `parts` open."""
    part = await anext(parts, None)
    if part is None:
        return
    while True:
        yield part
        del part  # the reader copies what it needs: a part (up to a megabyte) is not held while the next is awaited
        try:
            async with asyncio.timeout(timeout_s):
                part = await anext(parts)
        except StopAsyncIteration:
            return
        except TimeoutError as e:
            raise arrival_timeout("the message", timeout_s) from e
