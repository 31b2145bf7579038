"""An inference session's recovery policy: which spans to rebuild after a failure, on which servers, and who is blamed.

A span whose server failed or whose cache is out of step is rebuilt on a new route by replaying the steps it had
committed; a span that only ran a step the session did not commit is cut back by its next step instead. Every
failure counts against the step's RetryBudget (client/chain.py), the one retry policy of the client.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from swarmlm.client import trace
from swarmlm.client.chain import RetryBudget
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.session_links import SpanLink, close_all
from swarmlm.client.session_state import SessionState
from swarmlm.client.span_call import fetch_info
from swarmlm.errors import RemoteCallError
from swarmlm.protocol.bundle import SpanTensors

logger = logging.getLogger(__name__)


class Recovery:
    """Opens, repairs and rebuilds the links of one session (whose state it reads: blocks, batch, LoRA weights)."""

    def __init__(self, manager: SequenceManager, state: SessionState):
        self.manager, self.state = manager, state

    async def open_chain(self, start: int, end: int, batch: int, retry: RetryBudget) -> list[SpanLink]:
        """Links over blocks [start, end) on a new route, its spans opened all at once (one round trip, not one per
        server); the spans after one that failed to open are routed again from its blocks. On failure, every stream
        opened here is closed."""
        opened: list[SpanLink] = []
        max_length = self.state.max_length
        try:
            position = start
            while position < end:
                route = await retry.route(position, end, tokens=batch, session_tokens=batch * max_length)
                links = [SpanLink(self.manager, span, self.state.start) for span in route]
                opened += links  # closed below by any failure, an interrupted open's included
                opening = (link.open(batch, max_length) for link in links)
                results = await asyncio.gather(*opening, return_exceptions=True)
                errors: list[tuple[SpanLink, RemoteCallError]] = []
                for link, result in zip(links, results, strict=True):
                    if isinstance(result, RemoteCallError):
                        errors.append((link, result))
                    elif isinstance(result, BaseException):
                        raise result
                if not errors:
                    position = route[-1].end
                    continue
                first = links.index(errors[0][0])
                for link in links[first:]:
                    opened.remove(link)
                    await link.close()
                for link, error in errors:
                    retry.failed(link.span, error)
                position = route[first].start
            return opened
        except BaseException:
            await close_all(opened)
            raise

    async def repair(self, links: list[SpanLink], retry: RetryBudget) -> None:
        """Bring every span back to the session's position after a failed step (in place): a span that ran it without
        reordering its cache is cut back by its next step; one that reordered it, or whose server was lost, is
        rebuilt. If a rebuild fails, the spans not yet repaired stay as they are: the next step retries them."""
        repaired: list[SpanLink] = []
        for index, link in enumerate(list(links)):
            if not link.state.settle_failed_step(link.lost):
                repaired.append(link)
                continue
            await link.drop()
            try:
                trace.record_replay()
                repaired.extend(await self.rebuild(link, retry))
            except BaseException:
                links[:] = repaired + links[index:]
                raise
        links[:] = repaired

    async def replace_failed(self, link: SpanLink, error: RemoteCallError, retry: RetryBudget) -> list[SpanLink]:
        """A span's server failed a step: close its link, count the failure, and return its rebuilt replacement."""
        link.state.broken = True
        await link.close()
        retry.failed(link.span, error)
        trace.record_replay()
        return await self.rebuild(link, retry)

    async def rebuild(self, lost: SpanLink, retry: RetryBudget) -> list[SpanLink]:
        """Links on a new route for the lost span's blocks, their caches rebuilt from the steps it had committed."""
        batch, span = self.state.batch_size, lost.span
        if batch is None:
            raise RuntimeError("only a span of an open inference route can be rebuilt")
        while True:
            replacement = await self.open_chain(span.start, span.end, batch, retry)
            try:
                # one step per run of steps: a replay costs a few round trips, not one per token generated
                for step in lost.state.replay_plan(self.manager.request_limit(span.start, span.end)):
                    await self._replay(replacement, step)
                logger.info("Rebuilt blocks %d:%d from %d steps", span.start, span.end, len(lost.state.history))
                return replacement
            except RemoteCallError as e:
                await close_all(replacement)
                failed = next((s.span for s in replacement if s.span.peer_id == e.peer_id), span)
                retry.failed(failed, e)
            except BaseException:
                await close_all(replacement)
                raise

    async def _replay(self, links: list[SpanLink], step: SpanTensors) -> None:
        hidden = step.hidden
        for link in links:
            sent = replace(step, hidden=hidden)
            hidden = await link.send(sent, lora=self.state.lora)
            link.state.replayed(sent)

    async def after_push_failure(
        self, links: list[SpanLink], index: int, error: RemoteCallError | None, retry: RetryBudget
    ) -> None:
        """A pushed step failed at links[index] (error: its call failed; None: it could not push on). Close what may
        still receive the step, then count the failure (which may end the step)."""
        silent = error.peer_id if error is not None else None
        later = [i for i in range(index + 1, len(links)) if links[i].span.peer_id == silent]
        if error is not None and later:
            # a server the step was pushed on to went silent while this one waited for it: everything from here is
            # rebuilt (the step may still be on its way), and the failure is that server's, not this one's
            await drop_after(links, index)
            retry.failed(links[later[0]].span, error)
            return
        if error is not None and index > 0 and error.peer_id == links[index - 1].span.peer_id:
            index -= 1  # the server that should have pushed went silent: its cache is lost to us as well
            await drop_after(links, index)
        else:
            await drop_after(links, index if links[index].state.pending is None else index + 1)
        if error is not None:
            retry.failed(links[index].span, error)
        elif index + 1 < len(links):
            await self.blame_if_gone(links[index + 1], retry)

    async def blame_if_gone(self, link: SpanLink, retry: RetryBudget) -> None:
        """A server could not push to this one: the client asks it itself, and counts it failed only if it does not
        answer (one server's word never makes a client avoid another)."""
        peer_id = link.span.peer_id
        try:
            await asyncio.wait_for(fetch_info(self.manager, peer_id), max(self.manager.config.ping_timeout_s, 1.0))
        except TimeoutError:
            retry.failed(link.span, RemoteCallError("no answer after a failed push to it", peer_id))
        except RemoteCallError as e:
            retry.failed(link.span, e)


async def drop_after(links: list[SpanLink], index: int) -> None:
    """Close the links of links[index:] (they are rebuilt by the next step's repair)."""
    for link in links[index:]:
        await link.drop()
