"""Typed, versioned headers of every message on the wire; unknown fields and versions are rejected."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmlm.errors import ProtocolError

# Bumped on any incompatible change of a header or of the tensors that follow it.
PROTOCOL_VERSION = 1


class _Header(BaseModel):
    """Base of all headers: strict (no type coercion), frozen, and unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    protocol_version: int = PROTOCOL_VERSION


class ForwardRequest(_Header):
    """Run blocks [start_block, end_block) of the server's span over the hidden states that follow.

    Tensors, in order: hidden_states (batch, seq, hidden); then, if has_attention_mask, attention_mask
    (batch, seq) of 0/1; then, if has_position_ids, position_ids (batch, seq); then, if has_prompts, deep prompts
    (end_block - start_block, prefix, hidden), prompt i added to the first `prefix` positions of block i's input.
    The reply carries the output hidden states.
    """

    kind: Literal["forward"] = "forward"
    start_block: int = Field(ge=0)
    end_block: int = Field(ge=1)
    has_attention_mask: bool = False
    has_position_ids: bool = False
    has_prompts: bool = False


class BackwardRequest(ForwardRequest):
    """Gradients of a span, recomputed from its inputs (the server keeps nothing between forward and backward).

    Tensors: as ForwardRequest, with grad_outputs (batch, seq, hidden) right after hidden_states. The reply carries
    the gradient wrt hidden_states and, if has_prompts, the gradient wrt the prompts.
    """

    kind: Literal["backward"] = "backward"  # type: ignore[assignment]


class InferenceOpen(_Header):
    """First message of an inference stream: reserve a KV cache for blocks [start_block, end_block).

    No tensors. The reply (no tensors) confirms the reservation; then InferenceStep messages follow.
    """

    kind: Literal["open"] = "open"
    start_block: int = Field(ge=0)
    end_block: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    max_length: int = Field(ge=1)  # tokens the session may hold, past and new together


class InferenceStep(_Header):
    """New tokens of an open session: their hidden states after the session's blocks, using and extending its cache.

    Tensors, in order: hidden_states (batch, seq, hidden); if has_attention_mask, attention_mask (batch, past + seq)
    of 0/1; if has_position_ids, position_ids (batch, seq); if has_hypo_ids, hypo_ids (batch,): the cache's rows are
    reordered to these before the step (beam search); if has_prompts, deep prompts (blocks, prefix, hidden), added
    where the step's positions fall inside the prefix. The reply carries the output hidden states.
    """

    kind: Literal["step"] = "step"
    has_attention_mask: bool = False
    has_position_ids: bool = False
    has_hypo_ids: bool = False
    has_prompts: bool = False


class ReplyHeader(_Header):
    """The answer to a request: either tensors follow (ok) or an error explains what went wrong.

    error_kind "bad_request" means the request itself is invalid (another server would reject it too);
    "server" means this server failed to serve it, "busy" that it has no room now (the client may retry elsewhere),
    "too_large" that it exceeds this server's limits (another server may accept it).
    """

    ok: bool
    error: str | None = None
    error_kind: Literal["bad_request", "server", "busy", "too_large"] | None = None
    compute_ms: float = 0.0


def parse_header(data: dict[str, object], expected: type[_Header]) -> _Header:
    """Validate a decoded header dict; raise ProtocolError with a readable reason on any mismatch."""
    if not isinstance(data, dict):
        raise ProtocolError(f"header must be a mapping, got {type(data).__name__}")
    version = data.get("protocol_version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r}: this peer speaks version {PROTOCOL_VERSION}; "
            f"upgrade swarmlm on the older side"
        )
    try:
        return expected.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'header'}: {err['msg']}" for err in e.errors())
        raise ProtocolError(f"malformed {expected.__name__}: {problems}") from e
