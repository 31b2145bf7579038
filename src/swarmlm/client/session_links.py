"""An inference session's links to its servers: one stream per span to open it, send steps, read pushed ones, close."""

from __future__ import annotations

import secrets
from dataclasses import replace

import torch

from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.session_state import SpanState
from swarmlm.client.span_call import Expected, SpanStream
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.lora import LoraWeights
from swarmlm.protocol.messages import InferenceOpen, InferenceStep, PushHop
from swarmlm.swarm.routing import RouteSpan


class SpanLink:
    """One server's part of a session: the stream to it, and the state of its cache (client/session_state.py)."""

    def __init__(self, manager: SequenceManager, span: RouteSpan, session_start: int):
        self.span, self.session_start = span, session_start
        self.stream = SpanStream(manager, span.peer_id, "rpc_inference")
        self.session_id = secrets.token_hex(16)  # addresses steps other servers push to this server's session
        self.state = SpanState(span.start, span.end)
        self.lora_sent: LoraWeights | None = None  # the session's LoRA weights, once this server has them

    @property
    def lost(self) -> bool:
        """The server's cache is lost to us, or its stream is out of step (an interrupted step's reply may still
        come): either way the span must be rebuilt before it runs another step."""
        return self.state.broken or self.stream.out_of_step

    def hop(self, position: int) -> PushHop:
        """Where a server pushes a step at `position` to, for this span to run it next."""
        return PushHop(peer_id=self.span.peer_id, session_id=self.session_id, start_from_position=position)

    async def open(self, batch_size: int, max_length: int) -> None:
        header = InferenceOpen(
            start_block=self.span.start, end_block=self.span.end, batch_size=batch_size, max_length=max_length,
            session_id=self.session_id, adapter=self.stream.manager.config.active_adapter,
        )  # fmt: skip
        await self.stream.exchange(header, [])

    async def send(
        self, inputs: SpanTensors, start_from: int | None = None, next_hops: list[PushHop] | None = None,
        lora: LoraWeights | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Run one step (inputs.prompts: the whole session's; this span gets its blocks' rows) and return its output
        hidden states; start_from first cuts the server's cache back to that many tokens; with next_hops the server
        also pushes its output on to them (see server/push.py). lora: the session's LoRA weights, sent with the
        first step that has them (the server keeps them for the session's later steps)."""
        sent = inputs
        if inputs.prompts is not None:
            offset = self.span.start - self.session_start
            sent = replace(inputs, prompts=inputs.prompts[offset : offset + self.span.end - self.span.start])
        spec = None
        if lora is not None and lora is not self.lora_sent:
            mine = lora.blocks(self.span.start, self.span.end)
            sent, spec = replace(sent, lora=mine.flat), mine.spec
        header = InferenceStep(
            tensors=sent.names(), start_from_position=start_from, next_hops=next_hops or [], lora=spec
        )
        # checked: the hidden states, shaped like ours. A server that pushes replies only once the next server
        # took the step (server/push.py), so a silent next server must fail this wait too, naming itself
        watch = [hop.peer_id for hop in next_hops or []]
        reply = await self.stream.exchange(header, sent.tensors(), watch=watch)
        self.lora_sent = lora or self.lora_sent
        return reply.required("hidden")

    async def receive(self, like: torch.Tensor, upstream: str) -> torch.Tensor:
        """The output of a step server `upstream` pushed here (shaped like the step's hidden states)."""
        reply = await self.stream.receive({"hidden": Expected.like(like)}, upstream)
        return reply.required("hidden")

    @property
    def push_error(self) -> str | None:
        """Why the last step was not pushed on (None: it was, or it had no next hop)."""
        reply = self.stream.last_reply
        return None if reply is None else reply.push_error

    async def close(self) -> None:
        await self.stream.close()

    async def drop(self) -> None:
        """Close the link for good (once): the server's cache is lost to us."""
        if not self.state.broken:
            self.state.broken = True
            await self.close()


async def close_all(links: list[SpanLink]) -> None:
    for link in links:
        await link.close()
