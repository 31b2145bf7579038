"""An inference session's recovery, carried out: the plans of client/session_plan.py executed over the links.

A span whose server failed or whose cache is out of step is rebuilt on a new route by replaying the steps it had
committed; a span that only ran a step the session did not commit is cut back by its next step instead. What to keep,
rebuild, close or blame is decided by the plan functions from the session's state; this module opens, replays, closes
and counts, and edits the session's route only through SessionState.splice. Every failure counts against the step's
RetryBudget (client/chain.py), the one retry policy of the client.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from swarmlm.client import trace
from swarmlm.client.chain import RetryBudget
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.session_links import SpanLink, close_all
from swarmlm.client.session_plan import (
    Rebuild,
    blame_in_replay,
    plan_push_failure,
    plan_rebuild,
    plan_reopen,
    plan_repair,
)
from swarmlm.client.session_state import SessionState
from swarmlm.client.span_call import fetch_info
from swarmlm.errors import RemoteCallError
from swarmlm.protocol.bundle import SpanTensors

logger = logging.getLogger(__name__)


class Recovery:
    """Opens, repairs and rebuilds the route of one session (whose state it reads: blocks, batch, LoRA weights)."""

    def __init__(self, manager: SequenceManager, state: SessionState[SpanLink]):
        self.manager, self.state = manager, state

    async def open_route(self, batch: int, retry: RetryBudget) -> None:
        """The session's first route, over all its blocks, for steps of `batch` rows."""
        links = await self.open_chain(self.state.start, self.state.end, batch, retry)
        self.state.splice(0, len(self.state.route), links)
        self.state.batch_size = batch

    async def close_route(self) -> None:
        """Take every link out of the route and close it: the servers free the session's caches."""
        await close_all(self.state.splice(0, len(self.state.route), []))

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
                for result in results:
                    if isinstance(result, BaseException) and not isinstance(result, RemoteCallError):
                        raise result
                reopen = plan_reopen(route, [isinstance(result, RemoteCallError) for result in results])
                if reopen is None:
                    position = route[-1].end
                    continue
                for link in links[reopen.keep :]:
                    opened.remove(link)
                    await link.close()
                for link, result in zip(links, results, strict=True):
                    if isinstance(result, RemoteCallError):
                        retry.failed(link.span, result)
                position = reopen.from_block
            return opened
        except BaseException:
            await close_all(opened)
            raise

    async def repair(self, retry: RetryBudget) -> None:
        """Bring every span back to the session's position after a failed step, as plan_repair says: a span that ran
        it without reordering its cache is kept (its next step cuts it back); one that reordered it, or whose server
        was lost, is rebuilt in its place. If a rebuild fails, the spans not yet repaired stay as they are: the next
        step retries them."""
        index = 0  # the hop the plan's next entry is about (a replacement may take more than one hop)
        for action in plan_repair(self.state):
            link = self.state.route[index]
            link.state.settle_failed_step()
            if action is None:
                index += 1
                continue
            await link.drop()
            trace.record_replay()
            replacement = await self.rebuild(action, retry)
            self.state.splice(index, 1, replacement)
            index += len(replacement)

    async def replace_failed(self, index: int, error: RemoteCallError, retry: RetryBudget) -> None:
        """The server of hop `index` failed a step: close its link, count the failure, and put its rebuilt
        replacement in its place."""
        link = self.state.route[index]
        link.state.broken = True
        await link.close()
        retry.failed(link.span, error)
        trace.record_replay()
        self.state.splice(index, 1, await self.rebuild(plan_rebuild(link), retry))

    async def rebuild(self, plan: Rebuild, retry: RetryBudget) -> list[SpanLink]:
        """Links on a new route for the plan's blocks, their caches rebuilt from the steps the lost span had
        committed (the caller puts them in the route, or not: a spot check's links are only candidates)."""
        batch = self.state.batch_size
        if batch is None:
            raise RuntimeError("only a span of an open inference route can be rebuilt")
        while True:
            replacement = await self.open_chain(plan.start, plan.end, batch, retry)
            try:
                for step in plan.requests(self.manager.request_limit(plan.start, plan.end)):
                    await self._replay(replacement, step)
                logger.info("Rebuilt blocks %d:%d from %d steps", plan.start, plan.end, len(plan.history))
                return replacement
            except RemoteCallError as e:
                await close_all(replacement)
                retry.failed(blame_in_replay(plan, [link.span for link in replacement], e.peer_id), e)
            except BaseException:
                await close_all(replacement)
                raise

    async def _replay(self, links: list[SpanLink], step: SpanTensors) -> None:
        hidden = step.hidden
        for link in links:
            sent = replace(step, hidden=hidden)
            hidden = await link.send(sent, lora=self.state.lora)
            link.state.replayed(sent)

    async def after_push_failure(self, index: int, error: RemoteCallError | None, retry: RetryBudget) -> None:
        """A pushed step failed at hop `index` (error: its call failed; None: it could not push on). Close what may
        still receive the step, then count the failure (which may end the step), as plan_push_failure says."""
        plan = plan_push_failure(self.state, index, error is not None, None if error is None else error.peer_id)
        route = self.state.route
        for link in route[plan.drop_from :]:
            await link.drop()  # rebuilt by the next step's repair
        if error is not None and plan.blame is not None:
            retry.failed(route[plan.blame].span, error)
        elif plan.ask is not None:
            await self.blame_if_gone(route[plan.ask], retry)

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
