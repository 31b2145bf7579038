"""A test-only server that misbehaves on purpose: the project's own Server with a handler that lies.

Run as `python hostile_server.py MODE_FILE serve MODEL --blocks ...` (the arguments of `swarmlm serve`). Before each
forward or backward request it reads its behaviour from MODE_FILE, so one process can play many parts:

  honest       the real handler
  nan          replies of the right shape full of NaN
  wrong_shape  replies one position short
  wrong_dtype  replies in float16
  huge         a reply that announces and streams HUGE_REPLY_BYTES of tensor data
  bad_request, server, busy, too_large   an error reply of that kind
  hang_2rows   requests of 2 rows hang (and log when the client gives up on them); others fail as "server"
  too_large_rows   requests of more than one row are "too_large"; one row is served honestly
  perturb      computes honestly, then scales its forward and inference outputs by 1 + PERTURBATION: well formed,
               finite, plausible and wrong
  perturb_sometimes   perturbs a forward reply with probability 1/2 (inference steps stay honest)
  perturb_sessions    perturbs inference steps only (forward and backward stay honest)

It announces a tempting throughput so that a fresh client routes through it first. No production code has these
behaviours: they live in this file only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from hivemind.proto import runtime_pb2

from swarmlm.cli import main as cli
from swarmlm.protocol.bundle import ReplyName, ReplyTensors
from swarmlm.protocol.codec import CHUNK_BYTES, encode, read_only_message
from swarmlm.protocol.messages import ForwardRequest, ReplyHeader
from swarmlm.server import backend as backend_module
from swarmlm.server import server as server_module
from swarmlm.server import speed
from swarmlm.server.handler import Parts, Replies, SpanHandler
from swarmlm.server.validation import check_span_request

# what a "huge" reply streams: far more than any reply of the tests' tiny models
HUGE_REPLY_BYTES = 512 << 20
# throughput announced: beats honest servers in a fresh client's route costs
TEMPTING_THROUGHPUT = 1e9
# printed (and so in the server's log) when the client closed a hanging request's stream
CANCELLED_LINE = "HOSTILE request cancelled by the client"
SERVED_LINE = "HOSTILE served honestly"

# relative change of a perturbed output: far above the float32 tolerance of spot checks, small enough to look sane
PERTURBATION = 0.02
PERTURBED_LINE = "HOSTILE perturbed"

# given first on the command line; tests import this module for its constants, with other arguments
MODE_FILE = Path(sys.argv[1]) if __name__ == "__main__" else Path("/nonexistent-mode-file")


class HostileHandler(SpanHandler):
    async def _serve(self, requests: Parts, context: object, header_type: type[ForwardRequest]) -> Replies:
        mode = MODE_FILE.read_text().strip()
        if mode == "honest" or mode.startswith("perturb"):  # perturbing happens in the backend, after computing
            async for part in super()._serve(requests, context, header_type):
                yield part
            print(SERVED_LINE, flush=True)
            return
        header, tensors = await read_only_message(requests, header_type, max_bytes=self.max_request_bytes)
        hidden = tensors[0]
        if mode == "too_large_rows" and hidden.shape[0] == 1:
            inputs = check_span_request(header, tensors, self.backend.limits)
            bundle, _ = await self.backend.run(header.start_block, header.end_block, inputs)
            for part in encode(
                ReplyHeader(ok=True, tensors=bundle.names()), bundle.tensors(), runtime_pb2.ExpertResponse
            ):
                yield part
            print(SERVED_LINE, flush=True)
            return
        async for part in _misbehave(mode, header, hidden, tensors):
            yield part


async def _misbehave(mode: str, header: ForwardRequest, hidden: torch.Tensor, tensors: list) -> Replies:
    outputs = [hidden.clone()]
    names: list[ReplyName] = ["hidden"]  # named as an honest reply would name them: only their values misbehave
    if header.kind == "backward":
        names = ["grad_hidden"]
        if "prompts" in header.tensors:
            outputs.append(torch.zeros_like(tensors[header.tensors.index("prompts")]))
            names.append("grad_prompts")
    if mode == "nan":
        outputs[0][..., 0] = float("nan")
    elif mode == "wrong_shape":
        outputs[0] = outputs[0][:, :-1]
    elif mode == "wrong_dtype":
        outputs[0] = outputs[0].half()
    elif mode == "huge":
        async for part in _huge_reply():
            yield part
        return
    elif mode == "hang_2rows" and hidden.shape[0] == 2:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            print(CANCELLED_LINE, flush=True)
            raise
    elif mode in ("bad_request", "server", "busy", "too_large", "hang_2rows", "too_large_rows"):
        kind = {"hang_2rows": "server", "too_large_rows": "too_large"}.get(mode, mode)
        reply = ReplyHeader(ok=False, error=f"hostile server says {kind}", error_kind=kind)
        for part in encode(reply, [], runtime_pb2.ExpertResponse):
            yield part
        return
    else:
        raise ValueError(f"unknown hostile mode {mode!r}")
    for part in encode(ReplyHeader(ok=True, tensors=names), outputs, runtime_pb2.ExpertResponse):
        yield part


async def _huge_reply() -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """One float32 tensor of HUGE_REPLY_BYTES, streamed from one reused chunk (this process stays small)."""
    chunks = HUGE_REPLY_BYTES // CHUNK_BYTES
    buffer = bytes(CHUNK_BYTES)
    first = next(encode(ReplyHeader(ok=True, tensors=["hidden"]), [torch.zeros(1)], runtime_pb2.ExpertResponse))
    head = first.tensors[0]
    head.buffer, head.chunks = buffer, chunks
    del head.size[:]
    head.size.append(HUGE_REPLY_BYTES // 4)
    yield first
    for _ in range(chunks - 1):
        yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=buffer)])


def _perturbed(reply: ReplyTensors, kind: str) -> ReplyTensors:
    mode = MODE_FILE.read_text().strip()
    if (
        (mode == "perturb" and kind in ("forward", "step"))
        or (mode == "perturb_sometimes" and kind == "forward" and random.random() < 0.5)
        or (mode == "perturb_sessions" and kind == "step")
    ):
        print(PERTURBED_LINE, flush=True)
        first = reply.names()[0]  # the hidden states, or a backward's gradient wrt them
        return dataclasses.replace(reply, **{first: getattr(reply, first) * (1 + PERTURBATION)})
    return reply


def _perturbing_backend() -> None:
    honest_run, honest_step = backend_module.SpanBackend.run, backend_module.SpanBackend.step

    async def run(self, start, end, inputs, *args, **kwargs):  # as patched
        reply, compute_ms = await honest_run(self, start, end, inputs, *args, **kwargs)
        return _perturbed(reply, "forward" if inputs.grad_outputs is None else "backward"), compute_ms

    async def step(self, *args, **kwargs):
        reply, compute_ms = await honest_step(self, *args, **kwargs)
        return _perturbed(reply, "step"), compute_ms

    backend_module.SpanBackend.run, backend_module.SpanBackend.step = run, step


def main() -> int:
    server_module.SpanHandler = HostileHandler  # the Server builds this handler
    _perturbing_backend()
    backend_module.SpanBackend.measure_throughput = lambda self, *args, **kwargs: TEMPTING_THROUGHPUT
    # measured every start, never from the speeds kept on this machine (those are honest servers' figures)
    speed.known_speed = lambda folder, key, measure, remeasure=False: speed.Speed(*measure(), speed.MEASURED_NOW, 0.0)
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
