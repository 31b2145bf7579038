"""Typed, versioned headers of every message on the wire; unknown fields and versions are rejected."""

from __future__ import annotations

from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from swarmlm.errors import ProtocolError
from swarmlm.protocol.bundle import ReplyName, TensorName, check_names, check_reply_names
from swarmlm.protocol.lora import LoraSpec

# Bumped on any incompatible change of a header, of the tensors that follow it, or of who closes a stream first
# (5: the asker closes a one-reply stream once it has read the reply; net/transport.py; 6: replies name their tensors,
# protocol.bundle.ReplyTensors; 7: a forward may ask the server to keep its graph for the backward, `keep`/`kept`).
PROTOCOL_VERSION = 7
# the id under which a server keeps a forward's graph for its backward: 64 to 128 random bits in hex, per sender
KEEP_ID_PATTERN = r"^[0-9a-f]{16,32}$"
# a LoRA adapter's name in requests and records (models/adapters.py names adapters by their folder)
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class _Header(BaseModel):
    """Base of all headers: strict (no type coercion), frozen, and unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    protocol_version: int = PROTOCOL_VERSION


def _hidden_only() -> list[TensorName]:
    return ["hidden"]


class _TensorsHeader(_Header):
    """A header followed by a SpanTensors bundle: `tensors` names what follows, in wire order (protocol.bundle)."""

    # the tensors this kind of message may carry
    ALLOWED: ClassVar[tuple[str, ...]] = ("hidden",)

    tensors: list[TensorName] = Field(default_factory=_hidden_only, strict=False)
    int8: bool = False  # float tensors travel as int8 with per-row scales (protocol/int8.py); replies do the same

    @field_validator("tensors")
    @classmethod
    def _known_names_in_order(cls, names: list[str]) -> list[str]:
        try:
            check_names(names, cls.ALLOWED)
        except ProtocolError as e:
            raise ValueError(str(e)) from e
        return names


class ForwardRequest(_TensorsHeader):
    """Run blocks [start_block, end_block) of the server's span over the bundle that follows.

    Tensors: hidden (batch, seq, hidden), optionally attention_mask (batch, seq), position_ids (batch, seq) and deep
    prompts ((end_block - start_block) blocks, prefix or per-sample, added to the first positions of each block's
    input), and the client's LoRA weights of those blocks ("lora", described by the `lora` field, protocol.lora).
    The reply carries the output hidden states.
    """

    ALLOWED: ClassVar[tuple[str, ...]] = ("hidden", "attention_mask", "position_ids", "prompts", "lora")

    kind: Literal["forward"] = "forward"
    start_block: int = Field(ge=0)
    end_block: int = Field(ge=1)
    adapter: str | None = Field(default=None, pattern=ADAPTER_NAME_PATTERN)  # a LoRA adapter served here (None: none)
    lora: LoraSpec | None = None  # describes the "lora" tensor: the sender's own LoRA weights
    # keep the forward's graph under this id for the sender's backward that follows (server/activations.py); the
    # server may not (it says nothing either way): the backward then recomputes the forward
    keep: str | None = Field(default=None, pattern=KEEP_ID_PATTERN)


class BackwardRequest(ForwardRequest):
    """Gradients of a span: from the graph its forward kept (`kept`: the forward's `keep`) when the server still
    holds it and it was made from exactly these inputs, else recomputed from the inputs.

    Tensors: as ForwardRequest, with grad_outputs (batch, seq, hidden). The reply carries the gradient wrt
    hidden_states, if prompts were sent, the gradient wrt the prompts, and if LoRA weights were sent, the gradient
    wrt them (flat, laid out like them).
    """

    ALLOWED: ClassVar[tuple[str, ...]] = (
        "hidden", "grad_outputs", "attention_mask", "position_ids", "prompts", "lora"
    )  # fmt: skip

    kind: Literal["backward"] = "backward"  # type: ignore[assignment]
    kept: str | None = Field(default=None, pattern=KEEP_ID_PATTERN)

    @model_validator(mode="after")
    def _keeps_nothing(self) -> BackwardRequest:
        if self.keep is not None:
            raise ValueError("a backward keeps no graph (keep is for forwards)")
        return self


# a session's id: 128 random bits in hex, known only to its client and the servers of its route (it addresses pushes)
SESSION_ID_PATTERN = r"^[0-9a-f]{32}$"
# most servers a pushed step may still travel through
MAX_HOPS = 64


class PushHop(BaseModel):
    """The next server of a pushed step: its peer id, the id of the session there, and the position its cache is
    cut back to before the step (the client's view of that session)."""

    peer_id: str = Field(min_length=1, max_length=128)
    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    start_from_position: int = Field(ge=0)


class InferenceOpen(_Header):
    """First message of an inference stream: reserve a KV cache for blocks [start_block, end_block).

    No tensors. The reply (no tensors) confirms the reservation; then InferenceStep messages follow.
    """

    kind: Literal["open"] = "open"
    start_block: int = Field(ge=0)
    end_block: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    max_length: int = Field(ge=1)  # tokens the session may hold, past and new together
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)  # set: other servers may push steps
    adapter: str | None = Field(default=None, pattern=ADAPTER_NAME_PATTERN)  # every step runs with this LoRA adapter


class InferenceStep(_TensorsHeader):
    """New tokens of an open session: their hidden states after the session's blocks, using and extending its cache.

    Tensors: hidden (batch, seq, hidden), seq >= 0 (an empty step is a no-op, or only a rollback); optionally
    attention_mask (batch, past + seq) of 0/1, position_ids (batch, seq), hypo_ids (batch,): the cache's rows are
    reordered to these before the step (beam search), and deep prompts (blocks, prefix or per-sample), added where
    the step's positions fall inside the prefix. With start_from_position, the session's cache is first cut back
    to that many tokens (speculative decoding, rewinding). The reply carries the output hidden states.

    With next_hops, the server also pushes its output to the session of next_hops[0] (rpc_push, a PushStep with the
    rest of the hops), so the step travels server to server; the reply says whether that push was accepted.

    With `lora` (and the "lora" tensor: LoRA weights of the session's blocks), the session keeps those weights and
    runs this step and every later one with them, until a step brings others.
    """

    ALLOWED: ClassVar[tuple[str, ...]] = ("hidden", "attention_mask", "position_ids", "hypo_ids", "prompts", "lora")

    kind: Literal["step"] = "step"
    lora: LoraSpec | None = None  # describes the "lora" tensor
    start_from_position: int | None = Field(default=None, ge=0)
    next_hops: list[PushHop] = Field(default_factory=list, max_length=MAX_HOPS, strict=False)


class PushStep(_TensorsHeader):
    """A step of an open session sent by the previous server of its route rather than by its client (rpc_push).

    Tensors: hidden (batch, seq, hidden), optionally attention_mask and position_ids, as in InferenceStep (no
    reorders, no prompts: those steps always come from the client). The server runs it as a step of the session
    `session_id`, answers it on the client's stream, and pushes on to next_hops. The reply to the pusher (no
    tensors) says only whether the step was accepted.
    """

    ALLOWED: ClassVar[tuple[str, ...]] = ("hidden", "attention_mask", "position_ids")

    kind: Literal["push"] = "push"
    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    start_from_position: int = Field(ge=0)
    next_hops: list[PushHop] = Field(default_factory=list, max_length=MAX_HOPS, strict=False)


class ReplyHeader(_Header):
    """The answer to a request: either tensors follow (ok), named by `tensors` in wire order (a ReplyTensors bundle,
    protocol.bundle), or an error explains what went wrong (and no tensors follow).

    error_kind "bad_request" means the request itself is invalid (another server would reject it too);
    "server" means this server failed to serve it, "busy" that it has no room now, "too_large" that the request
    exceeds this server's own limits (another server may accept it), "timeout" that the request stopped arriving
    (its next bytes did not come within the server's arrival deadline), and "not_served" that the request names
    blocks or a LoRA adapter this server does not hold (the sender's view of it is out of date): the client may retry
    elsewhere. A peer that does not know a kind reads the reply as malformed, which it treats as that server's failure
    too.
    """

    ok: bool
    tensors: list[ReplyName] = Field(default_factory=list, strict=False)  # what follows: ReplyTensors.names()
    error: str | None = None
    error_kind: Literal["bad_request", "server", "busy", "too_large", "timeout", "not_served"] | None = None
    compute_ms: float = 0.0
    int8: bool = False  # its float tensors travel as int8 with per-row scales (as the request's did)
    push_error: str | None = None  # a step with next_hops ran, but pushing it on failed (the client takes over)
    # with error_kind "busy": the server's estimate of the seconds until it has room (a session of its ends)
    retry_after_s: float | None = Field(default=None, ge=0, le=86400, allow_inf_nan=False)

    @field_validator("tensors")
    @classmethod
    def _known_names_in_order(cls, names: list[str]) -> list[str]:
        try:
            check_reply_names(names)
        except ProtocolError as e:
            raise ValueError(str(e)) from e
        return names

    @model_validator(mode="after")
    def _no_tensors_with_an_error(self) -> ReplyHeader:
        if not self.ok and self.tensors:
            raise ValueError("a refusal carries no tensors")
        return self


H = TypeVar("H", bound=_Header)


def parse_header(data: dict[str, object], expected: type[H]) -> H:
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


class InfoRequest(_Header):
    """Ask a server to describe itself (rpc_info). No tensors; the reply is one ServerInfo message."""

    kind: Literal["info"] = "info"


class ServerInfo(_Header):
    """What a server says about itself right now: its span, identity, limits, free cache and speed."""

    # newer servers may say more: a client reads what it knows
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    kind: Literal["server_info"] = "server_info"
    start_block: int  # first block served
    end_block: int  # one past the last block served
    version: str  # swarmlm version of the server
    fingerprint: str  # the model's fingerprint (models/fingerprint.py)
    dtype: str  # compute dtype of the blocks
    max_tokens_per_request: int  # batch * sequence tokens one request may carry
    max_position: int  # the model's context: positions and session lengths stay below it
    cache_tokens_total: int  # the KV-cache budget, in block-tokens (one token's keys and values at one block)
    cache_tokens_left: int  # block-tokens of it not reserved by open sessions
    sessions_open: int  # inference sessions open now
    queue_depth: float = 0.0  # compute turns a new request waits for, averaged over recent seconds
    throughput: float  # forward tokens/s through one block, measured at start-up
    inference_throughput: float  # one-token decode steps/s through one block, measured at start-up
    pushes_received: int = 0  # inference steps other servers pushed here (server-to-server push)
    adapters: tuple[str, ...] = Field(default=(), strict=False)  # LoRA adapters requests may name (a list on the wire)
