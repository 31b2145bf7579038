"""A TCP relay that delays (and optionally rate-limits) every byte, per direction: emulated wide-area links.

The kernel here has no netem, so latency is added in user space: each chunk read from one side is written to the
other `delay_s` after it arrived, keeping order; with a rate cap, writes are also paced to `rate_bps`. Buffered
bytes per direction are bounded (reading pauses above the bound), so a fast sender cannot grow the relay's memory.

Run as `python -m swarmlm.tools.netbed.relay --listen HOST:PORT --to HOST:PORT [--delay-ms X] [--rate-mbit Y]`;
it prints "Relay ready" once listening and exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

READY_LINE = "Relay ready"
# bytes read per chunk: small enough that pacing stays smooth at a few Mbit/s
READ_BYTES = 64 << 10
# bytes one direction may hold in flight: a 100 Mbit/s link with 200 ms of delay holds 2.5 MB
MAX_BUFFERED_BYTES = 8 << 20
# a connection to the target that does not open within this time is dropped
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LinkShape:
    """One direction of an emulated link."""

    delay_s: float = 0.0  # added one-way delay
    rate_bps: float = 0.0  # bits per second (0: unlimited)


class _Pipe:
    """Copies one direction: reads chunks as they come, writes each `delay_s` after it was read, paced to the rate."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shape: LinkShape):
        self.reader, self.writer, self.shape = reader, writer, shape
        self._chunks: deque[tuple[float, bytes]] = deque()
        self._buffered = 0
        self._changed = asyncio.Event()

    async def run(self) -> None:
        sender = asyncio.create_task(self._send())
        try:
            await self._receive()
            await sender
        finally:
            sender.cancel()

    async def _receive(self) -> None:
        while data := await self.reader.read(READ_BYTES):
            while self._buffered >= MAX_BUFFERED_BYTES:
                self._changed.clear()
                await self._changed.wait()
            self._chunks.append((time.monotonic() + self.shape.delay_s, data))
            self._buffered += len(data)
            self._changed.set()
        self._chunks.append((time.monotonic() + self.shape.delay_s, b""))  # end of stream, delayed like the data
        self._changed.set()

    async def _send(self) -> None:
        free_at = 0.0  # when the emulated link has sent what it was given (rate cap)
        while True:
            while not self._chunks:
                self._changed.clear()
                await self._changed.wait()
            due, data = self._chunks.popleft()
            self._buffered -= len(data)
            self._changed.set()
            if self.shape.rate_bps > 0:
                free_at = max(free_at, time.monotonic()) + len(data) * 8 / self.shape.rate_bps
                due = max(due, free_at)
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    self.writer.write_eof()
                return
            self.writer.write(data)
            await self.writer.drain()


async def _serve_connection(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    target: tuple[str, int],
    inbound: LinkShape,
    outbound: LinkShape,
) -> None:
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            target_reader, target_writer = await asyncio.open_connection(*target)
    except (OSError, TimeoutError) as e:
        logger.warning("Relay cannot reach %s:%d: %s", *target, e)
        client_writer.close()
        return
    pipes = [_Pipe(client_reader, target_writer, inbound), _Pipe(target_reader, client_writer, outbound)]
    tasks = [asyncio.create_task(pipe.run()) for pipe in pipes]
    try:
        # both directions end by EOF (half-closes pass through); a failure of either ends the connection
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        for writer in (client_writer, target_writer):
            writer.close()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await task


async def serve(listen: tuple[str, int], target: tuple[str, int], inbound: LinkShape, outbound: LinkShape) -> None:
    """Relay connections to `listen` to `target` until cancelled (or SIGTERM when run as a program).

    inbound shapes the bytes towards the target, outbound the replies."""
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, target, inbound, outbound), *listen, reuse_address=True
    )
    async with server:
        print(READY_LINE, flush=True)
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=_address, required=True, metavar="HOST:PORT")
    parser.add_argument("--to", type=_address, required=True, metavar="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added in each direction")
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="rate cap per connection and direction")
    args = parser.parse_args(argv)
    shape = LinkShape(args.delay_ms / 1000, args.rate_mbit * 1e6)

    async def run() -> None:
        task = asyncio.ensure_future(serve(args.listen, args.to, shape, shape))
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
