"""Framing of one message (a typed header plus tensors) as a stream of hivemind protobuf parts.

A message is one or more parts. The first part's metadata holds msgpack {"header": {...}, "n_tensors": k}; the k
serialized tensors follow as chunks (each tensor's first chunk carries its dtype, shape and chunk count), spread
over parts of bounded size, so tensors of any size pass the transport's per-message cap.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TypeVar

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarmlm.errors import ProtocolError
from swarmlm.protocol.messages import _Header, parse_header

# Parts stay well below the transport's 4 MiB per-message cap.
CHUNK_BYTES = 1 << 20
# dtypes that may travel; anything else is refused before deserialization.
WIRE_DTYPES = {"float32", "float16", "bfloat16", "int64", "int32", "bool"}
# A header larger than this is malformed, whatever it says.
MAX_METADATA_BYTES = 64 << 10
# More tensors than any request kind uses: the rest is malformed.
MAX_TENSORS = 16

H = TypeVar("H", bound=_Header)
Part = runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse


def encode(header: _Header, tensors: Sequence[torch.Tensor], part_type: type[Part]) -> Iterator[Part]:
    """Yield the parts of one message; tensors are moved to CPU and sent uncompressed."""
    metadata = msgpack.packb({"header": header.model_dump(), "n_tensors": len(tensors)})
    chunks = [chunk for tensor in tensors for chunk in _split(tensor)]
    first = part_type(metadata=metadata)
    if not chunks:
        yield first
        return
    first.tensors.append(chunks[0])
    yield first
    for chunk in chunks[1:]:
        yield part_type(tensors=[chunk])


def _split(tensor: torch.Tensor) -> list[runtime_pb2.Tensor]:
    chunks = list(split_for_streaming(serialize_torch_tensor(tensor.detach().cpu()), CHUNK_BYTES))
    chunks[0].chunks = max(chunks[0].chunks, 1)  # an empty tensor (an empty step) still travels as one chunk
    return chunks


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
    tensors = await _read_tensors(first, parts, meta["n_tensors"], max_bytes)
    return header, tensors


async def read_only_message(
    parts: AsyncIterator[Part], header_type: type[H], *, max_bytes: int
) -> tuple[H, list[torch.Tensor]] | None:
    """Read a stream that must carry exactly one message, up to its end (so the sender finishes writing)."""
    message = await read_message(parts, header_type, max_bytes=max_bytes)
    if message is not None and await anext(parts, None) is not None:
        raise ProtocolError("the stream carries more than the one message expected")
    return message


async def drain(parts: AsyncIterator[Part], max_bytes: int) -> None:
    """Consume what the sender still sends (up to max_bytes), so an early error reply does not break its pipe."""
    received = 0
    async for part in parts:
        received += sum(len(chunk.buffer) for chunk in part.tensors) + len(part.metadata)
        if received > max_bytes:
            return


async def _read_tensors(first: Part, parts: AsyncIterator[Part], n_tensors: int, max_bytes: int) -> list[torch.Tensor]:
    if not 0 <= n_tensors <= MAX_TENSORS:
        raise ProtocolError(f"a message carries 0..{MAX_TENSORS} tensors, not {n_tensors}")
    chunks: list[runtime_pb2.Tensor] = list(first.tensors)
    received = sum(len(chunk.buffer) for chunk in chunks)
    if received > max_bytes:
        raise ProtocolError(f"message carries more than {max_bytes} bytes of tensors")

    async def ensure(count: int) -> None:
        # pull parts until at least `count` chunks of this message have arrived
        nonlocal received
        while len(chunks) < count:
            part = await anext(parts, None)
            if part is None:
                raise ProtocolError(f"stream ended inside a message of {n_tensors} tensors")
            chunks.extend(part.tensors)
            received += sum(len(chunk.buffer) for chunk in part.tensors)
            if received > max_bytes:
                raise ProtocolError(f"message carries more than {max_bytes} bytes of tensors")

    tensors, used = [], 0
    for index in range(n_tensors):
        await ensure(used + 1)
        head = chunks[used]
        if head.dtype not in WIRE_DTYPES or head.chunks < 1:
            raise ProtocolError(f"tensor {index}: unsupported dtype {head.dtype!r} or missing chunk count")
        await ensure(used + head.chunks)
        tensors.append(_deserialize(chunks[used : used + head.chunks], index))
        used += head.chunks
    if len(chunks) != used:
        raise ProtocolError(f"message carries more tensor chunks than its {n_tensors} tensors")
    return tensors


def _deserialize(chunks: list[runtime_pb2.Tensor], index: int) -> torch.Tensor:
    try:
        return deserialize_torch_tensor(combine_from_streaming(chunks))
    except (ValueError, TypeError, RuntimeError, KeyError) as e:
        raise ProtocolError(f"tensor {index} cannot be decoded: {e}") from e
