"""Framing of one message (a typed header plus tensors) as a stream of hivemind protobuf parts.

A message is one or more parts. The first part's metadata holds msgpack {"header": {...}, "n_tensors": k}; the k
serialized tensors follow as chunks (each tensor's first chunk carries its dtype, shape and chunk count), spread
over parts of bounded size, so tensors of any size pass the transport's per-message cap.

In a message whose header says int8, every float tensor travels in 8-bit form (protocol/int8.py): its int8 values,
then its float32 scales as one more serialized tensor; readers return it dequantized to float32. n_tensors counts
tensors as the header names them, not the scales.
"""

from __future__ import annotations

import math
import mmap
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TypeAlias, TypeVar

import msgpack
import torch
from hivemind.compression.base import USE_LEGACY_BFLOAT16
from hivemind.proto import runtime_pb2

from swarmlm.errors import ProtocolError
from swarmlm.protocol.int8 import dequantize_rows, quantizable, quantize_rows
from swarmlm.protocol.messages import _Header, parse_header

# Parts stay well below the transport's 4 MiB per-message cap.
CHUNK_BYTES = 1 << 20
# dtypes that may travel; anything else is refused before deserialization.
WIRE_DTYPES = {"float32", "float16", "bfloat16", "int64", "int32", "int8", "bool"}
# A header larger than this is malformed, whatever it says.
MAX_METADATA_BYTES = 64 << 10
# More tensors than any request kind uses: the rest is malformed.
MAX_TENSORS = 16
# Our senders put one chunk in a part; more than this in one part is malformed (empty chunks cost memory, not bytes).
MAX_CHUNKS_PER_PART = 16
# Smallest chunk hivemind's splitter makes (its default): a tensor may declare at most its bytes / this + 1 chunks.
MIN_CHUNK_BYTES = 1 << 16
# Only uncompressed tensors are read: compressed ones expand before they could be checked (our senders never compress).
WIRE_COMPRESSION = {runtime_pb2.CompressionType.NONE}
# bytes per value on the wire (bfloat16 travels as 2 bytes, or as float32 from hivemind's legacy mode)
_WIRE_ITEM_BYTES = {
    "float32": (4,), "float16": (2,), "bfloat16": (2, 4), "int64": (8,), "int32": (4,), "int8": (1,), "bool": (1,)
}  # fmt: skip

H = TypeVar("H", bound=_Header)
Part: TypeAlias = runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse


def encode(header: _Header, tensors: Sequence[torch.Tensor], part_type: type[Part]) -> Iterator[Part]:
    """Yield the parts of one message; tensors are moved to CPU and sent uncompressed (in 8-bit form if the header
    says int8)."""
    metadata = msgpack.packb({"header": header.model_dump(), "n_tensors": len(tensors)})
    if is_int8(header):
        tensors = [part for t in tensors for part in (quantize_rows(t) if quantizable(t) else (t,))]
    # made as they are sent: a large tensor is never held serialized in full beside itself
    chunks = (chunk for tensor in tensors for chunk in _split(tensor))
    first = part_type(metadata=metadata)
    head = next(chunks, None)
    if head is None:
        yield first
        return
    first.tensors.append(head)
    yield first
    for chunk in chunks:
        yield part_type(tensors=[chunk])


def is_int8(header: _Header) -> bool:
    """Whether the message's float tensors travel in 8-bit form (a field of tensor-carrying headers and replies)."""
    return bool(getattr(header, "int8", False))


def _split(tensor: torch.Tensor) -> Iterator[runtime_pb2.Tensor]:
    """A tensor's chunks as hivemind's serialize_torch_tensor and split_for_streaming make them (uncompressed;
    bfloat16 as hivemind sends it), each copied out of the tensor's memory only when it is taken. An empty tensor
    (an empty step) still travels as one chunk."""
    tensor = tensor.detach().cpu()
    raw = tensor
    if tensor.dtype == torch.bfloat16:
        raw = tensor.to(torch.float32) if USE_LEGACY_BFLOAT16 else tensor.view(torch.int16)
    data = raw.contiguous().reshape(-1).view(torch.uint8)  # its bytes, not a copy
    count = max(1, math.ceil(data.numel() / CHUNK_BYTES))
    yield runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE, buffer=data[:CHUNK_BYTES].numpy().tobytes(), chunks=count,
        size=tensor.shape, dtype=str(tensor.dtype).removeprefix("torch."), requires_grad=tensor.requires_grad,
    )  # fmt: skip
    for begin in range(CHUNK_BYTES, data.numel(), CHUNK_BYTES):
        yield runtime_pb2.Tensor(buffer=data[begin : begin + CHUNK_BYTES].numpy().tobytes())


async def read_message(
    parts: AsyncIterator[Part], header_type: type[H], *, max_bytes: int
) -> tuple[H, list[torch.Tensor]] | None:
    """Read exactly one message from the stream; None if the stream ended cleanly before it began.

    Raises ProtocolError on a malformed header, a truncated stream, an unknown dtype or more than max_bytes of
    tensor data (the sender can then be answered with a clear error instead of exhausting memory).
    """
    first = await anext(parts, None)
    if first is None:
        return None
    if len(first.metadata) > MAX_METADATA_BYTES:
        raise ProtocolError(f"header of {len(first.metadata)} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        meta = msgpack.unpackb(first.metadata)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__} {e}".rstrip()) from e
    if not isinstance(meta, dict) or set(meta) != {"header", "n_tensors"} or not isinstance(meta["n_tensors"], int):
        raise ProtocolError("message metadata must be {'header': ..., 'n_tensors': int}")
    header = parse_header(meta["header"], header_type)
    chunks = _Chunks(first, parts, meta["n_tensors"])
    del first  # its chunks hold it until they are taken
    return header, await _read_tensors(chunks, meta["n_tensors"], max_bytes, is_int8(header))


async def read_only_message(
    parts: AsyncIterator[Part], header_type: type[H], *, max_bytes: int
) -> tuple[H, list[torch.Tensor]] | None:
    """Read a stream that must carry exactly one message, up to its end (so the sender finishes writing)."""
    message = await read_message(parts, header_type, max_bytes=max_bytes)
    if message is not None and await anext(parts, None) is not None:
        raise ProtocolError("the stream carries more than the one message expected")
    return message


# A refused message is refused from its first chunk's declared size, so up to this many whole messages may follow.
DRAIN_MESSAGES = 2


async def drain(parts: AsyncIterator[Part], max_bytes: int) -> None:
    """Consume what the sender still sends (up to DRAIN_MESSAGES * max_bytes), so an early error reply does not
    break its pipe."""
    max_bytes *= DRAIN_MESSAGES
    received = 0
    async for part in parts:
        received += part.ByteSize()  # counts empty chunks too
        if received > max_bytes:
            return


async def _read_tensors(chunks: _Chunks, n_tensors: int, max_bytes: int, int8: bool) -> list[torch.Tensor]:
    if not 0 <= n_tensors <= MAX_TENSORS:
        raise ProtocolError(f"a message carries 0..{MAX_TENSORS} tensors, not {n_tensors}")
    declared_total = 0

    async def next_tensor(index: int) -> torch.Tensor:
        # the next serialized tensor, checked against its declared size before any of it is decoded, then read
        # chunk by chunk into memory of that size as its parts arrive
        nonlocal declared_total
        head = await chunks.next()
        declared = _declared_bytes(head, index)
        declared_total += declared
        if declared_total > max_bytes:
            raise ProtocolError(f"message declares more than {max_bytes} bytes of tensors")
        if not 1 <= head.chunks <= declared // MIN_CHUNK_BYTES + 1:
            raise ProtocolError(f"tensor {index} of {declared} bytes declares {head.chunks} chunks")
        filling = _Filling(head, declared, index)
        del head  # a chunk holds its whole part: nothing keeps one longer than its bytes take to copy
        for _ in range(filling.chunks - 1):
            filling.add(await chunks.next(), first=False)
        return filling.tensor()

    tensors = []
    for index in range(n_tensors):
        tensor = await next_tensor(index)
        if tensor.dtype == torch.int8:  # 8-bit values: their scales follow
            if not int8:
                raise ProtocolError(f"tensor {index}: int8 tensors travel only in messages whose header says int8")
            tensor = dequantize_rows(tensor, await next_tensor(index), index)
        tensors.append(tensor)
    if chunks.pending:
        raise ProtocolError(f"message carries more tensor chunks than its {n_tensors} tensors")
    return tensors


class _Chunks:
    """A message's serialized chunks in order, each pulled from the parts as it is needed (a part is dropped once its
    chunks are taken)."""

    def __init__(self, first: Part, parts: AsyncIterator[Part], n_tensors: int):
        _check_part(first)
        self.pending: deque[runtime_pb2.Tensor] = deque(first.tensors)
        self.parts, self.n_tensors = parts, n_tensors

    async def next(self) -> runtime_pb2.Tensor:
        while not self.pending:
            part = await anext(self.parts, None)
            if part is None:
                raise ProtocolError(f"stream ended inside a message of {self.n_tensors} tensors")
            _check_part(part)
            self.pending.extend(part.tensors)
        return self.pending.popleft()


def _check_part(part: Part) -> None:
    if len(part.tensors) > MAX_CHUNKS_PER_PART:
        raise ProtocolError(f"a part carries {len(part.tensors)} chunks, more than {MAX_CHUNKS_PER_PART}")


def _declared_bytes(head: runtime_pb2.Tensor, index: int) -> int:
    """Bytes a tensor's first chunk declares (by shape and dtype), checked before any of its data is decoded."""
    if head.dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor {index}: unsupported dtype {head.dtype!r}")
    if head.compression not in WIRE_COMPRESSION:
        raise ProtocolError(f"tensor {index}: compression {head.compression} is not accepted; send uncompressed")
    if len(head.size) > 8 or any(dim < 0 for dim in head.size):
        raise ProtocolError(f"tensor {index}: malformed shape {list(head.size)}")
    return math.prod(head.size) * max(_WIRE_ITEM_BYTES[head.dtype])


# how each wire dtype reads back (bfloat16 also travels as float32: hivemind's legacy mode)
_TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
    "int32": torch.int32, "int8": torch.int8, "bool": torch.bool,
}  # fmt: skip


# a tensor of at least this many bytes is read into memory mapped for it alone: its pages are touched (and counted in
# the process's size) only as its bytes arrive, and go back to the system as soon as the tensor is freed, whatever
# the allocator keeps. glibc's own threshold rises to the largest block freed so far, after which a burst of large
# requests left their memory in its arenas: a server's RSS stayed twice what its byte budget counted
MAPPED_BYTES = 1 << 20


def _blank(nbytes: int) -> torch.Tensor:
    """nbytes of uninitialized memory, as a uint8 tensor (mapped on its own from MAPPED_BYTES up)."""
    if nbytes < MAPPED_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)


class _Filling:
    """A tensor being read: its chunks' bytes copied in as they arrive, into memory of the size its first chunk
    declares (nothing is held twice, and a chunk that would overflow it is refused before it is copied). It keeps
    no chunk: each holds its whole part."""

    def __init__(self, head: runtime_pb2.Tensor, declared: int, index: int):
        self.index, self.chunks = index, head.chunks
        self.dtype, self.shape, self.requires_grad = head.dtype, tuple(head.size), head.requires_grad
        self.data = _blank(declared)
        self.view = memoryview(self.data.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
        self.filled = 0
        self.add(head, first=True)

    def add(self, chunk: runtime_pb2.Tensor, first: bool) -> None:
        if not first and chunk.compression != runtime_pb2.CompressionType.NONE:
            raise ProtocolError(f"tensor {self.index}: only its first chunk may say how it is compressed")
        buffer = chunk.buffer  # a copy out of the message: taken once
        end = self.filled + len(buffer)
        if end > len(self.view):
            raise self._mismatch()
        self.view[self.filled : end] = buffer
        self.filled = end

    def tensor(self) -> torch.Tensor:
        """The tensor, once all its chunks are in: its bytes checked against its shape and dtype."""
        nbytes, numel = self.filled, math.prod(self.shape)
        if nbytes not in {numel * item for item in _WIRE_ITEM_BYTES[self.dtype]}:
            raise self._mismatch()
        self.view.release()
        try:
            data = self.data[:nbytes]
            if self.dtype == "bfloat16" and numel and nbytes // numel == 4:
                tensor = data.view(torch.float32).to(torch.bfloat16)
            else:
                tensor = data.view(_TORCH_DTYPES[self.dtype])
            return tensor.reshape(self.shape).requires_grad_(self.requires_grad)
        except (ValueError, TypeError, RuntimeError, KeyError) as e:
            raise ProtocolError(f"tensor {self.index} cannot be decoded: {e}") from e

    def _mismatch(self) -> ProtocolError:
        return ProtocolError(f"tensor {self.index} cannot be decoded: its buffer does not match its shape and dtype")
