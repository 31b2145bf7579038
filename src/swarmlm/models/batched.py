"""One-token decode steps of several sessions, each with its own KV cache, run through a span as one forward; and the
prompts of several fresh sessions, likewise (prefill_batched).

The projections and MLPs of all sessions run as one batch (that is where the batch pays: their weights are read once).
Attention runs session by session over each session's own cache, as Hugging Face's sdpa attention (or the family's
eager attention, for families that need it) runs it for a session alone: nothing is copied into a padded stack, so a
step's cost does not grow with the other sessions' histories, and each session's result is what it gets alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from swarmlm.models.registry import SLIDING_ATTENTION
from swarmlm.models.span import SpanModel

# the attention implementation a span's layers use during a batched decode step
SESSIONS_ATTENTION = "swarmlm_sessions"


class SessionCaches:
    """The `cache=` of a batched decode step: each layer's update goes to every session's own cache, and the layer's
    attention (sessions_attention) reads each session's keys/values from there."""

    def __init__(
        self, caches: Sequence[DynamicCache], rows: Sequence[int], windows: dict[int, int | None],
        masks: Sequence[torch.Tensor | None] | None = None, tokens: Sequence[int] | None = None,
        eager: Callable[..., tuple[torch.Tensor, Any]] | None = None,
    ):  # fmt: skip
        """windows: by global layer index, how many of the last positions a new token sees (None: all). masks: each
        session's padding mask over its history and new token, (rows, history + 1) bool, True where the new token
        may attend (None: everywhere). tokens: for prompts (prefill_batched), each session's number of new tokens,
        laid one after another along the sequence of a single row (rows are then all 1); None: one token per row.
        eager: the family's eager attention, which each session's attention then runs instead of sdpa."""
        self.caches, self.rows, self.windows, self.eager = list(caches), list(rows), windows, eager
        self.masks = list(masks) if masks is not None else [None] * len(self.caches)
        self.tokens = None if tokens is None else list(tokens)
        self.histories: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by layer, until its attention

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states (rows, kv_heads, 1, head_dim) go to their sessions' caches; returned as they are (the
        attention takes each session's whole history from self.histories)."""
        histories, row = [], 0
        if self.tokens is not None:  # (1, kv_heads, sum tokens, head_dim): each session's segment of the sequence
            for cache, count in zip(self.caches, self.tokens, strict=True):
                keys, values = key_states[:, :, row : row + count], value_states[:, :, row : row + count]
                histories.append(cache.update(keys, values, layer_idx))
                row += count
            self.histories[layer_idx] = histories
            return key_states, value_states
        for cache, rows in zip(self.caches, self.rows, strict=True):
            histories.append(cache.update(key_states[row : row + rows], value_states[row : row + rows], layer_idx))
            row += rows
        self.histories[layer_idx] = histories
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(cache.get_seq_length(layer_idx) for cache in self.caches)

    @property
    def is_compileable(self) -> bool:  # asked by some attention paths; a dynamic, Python-level cache is not
        return False


def sessions_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """The attention of a batched decode step: query (rows, heads, 1, dim) of all sessions; each session's rows attend
    over its own cached keys/values (the last `window` of them for a sliding-window layer) by Hugging Face's sdpa
    attention (or the family's eager one), called as for that session alone (with the same kind of mask, so it takes
    the same kernel). Returns (rows, 1, heads, dim), like sdpa_attention_forward."""
    batch = kwargs.pop("sessions", None)
    if not isinstance(batch, SessionCaches):
        raise RuntimeError(f"the {SESSIONS_ATTENTION!r} attention runs only inside decode_batched")
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]  # attention modules know their layer's index
    window = batch.windows.get(layer_idx)
    kwargs.update(dropout=dropout, scaling=scaling)
    outputs, row = [], 0
    if batch.tokens is not None:  # fresh prompts (prefill_batched): each segment attends causally over itself
        for count, (keys, values) in zip(batch.tokens, batch.histories.pop(layer_idx), strict=True):
            outputs.append(_attend(batch, module, query[:, :, row : row + count], keys, values, None, **kwargs))
            row += count  # outputs (1, count, heads, dim)
        return (torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]), None
    for rows, (keys, values), padding in zip(batch.rows, batch.histories.pop(layer_idx), batch.masks, strict=True):
        mask = None if padding is None else padding[:, None, None, :]
        if window is not None and keys.shape[-2] > window:
            # as the session's own sliding-window mask has it: the new token sees the last `window` positions
            recent = (torch.arange(keys.shape[-2], device=keys.device) >= keys.shape[-2] - window)[None, None, None, :]
            mask = recent if mask is None else mask & recent
        outputs.append(_attend(batch, module, query[row : row + rows], keys, values, mask, **kwargs))
        row += rows
    return (torch.cat(outputs) if len(outputs) > 1 else outputs[0]), None


def _attend(
    batch: SessionCaches, module: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    allowed: torch.Tensor | None, **kwargs: Any,
) -> torch.Tensor:  # fmt: skip
    """One session's attention: query (rows, heads, q, dim) over its keys/values (rows, kv_heads, k, dim); allowed
    (bool, broadcast to (rows, 1, q, k)) says what it may see, None: everything up to itself (causal). Returns
    (rows, q, heads, dim). Eager attention adds its mask to the scores and has no causal default, so its mask is a
    float one, made causal when a prompt (q > 1) comes without one, as Hugging Face's eager masks are."""
    if batch.eager is None:
        return sdpa_attention_forward(module, query, keys, values, allowed, **kwargs)[0]
    if allowed is None and query.shape[-2] > 1:  # a fresh prompt: keys are its own tokens
        allowed = torch.ones(query.shape[-2], keys.shape[-2], dtype=torch.bool, device=query.device).tril()
    mask = None
    if allowed is not None:
        mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)
    return batch.eager(module, query, keys, values, mask, **kwargs)[0]


AttentionInterface.register(SESSIONS_ATTENTION, sessions_attention)


def decode_batched(
    span: SpanModel, hidden: Sequence[torch.Tensor], caches: Sequence[DynamicCache], start: int, end: int,
    adapter: str | None = None, masks: Sequence[torch.Tensor | None] | None = None,
    positions: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """hidden[i] (rows_i, 1, hidden) is one new token of the session owning caches[i]; returns each session's output
    (rows_i, 1, hidden) after blocks [start, end), as if it had run alone, and appends its token to its own cache.
    All sessions use the same LoRA adapter (None: the base model). masks[i]: the session's attention mask over its
    history and the new token, (rows_i, history + 1), as a padded batch of prompts has it (None: no padding);
    positions[i]: its rows' position ids (rows_i, 1) (None: the history's length)."""
    span.use_adapter(adapter)
    rows = [h.shape[0] for h in hidden]
    states = torch.cat(list(hidden))  # (sum rows, 1, hidden)
    # each row continues at its own position
    given = list(positions) if positions is not None else [None] * len(caches)
    position_ids = torch.cat([
        torch.full((r, 1), cache.get_seq_length(start), dtype=torch.long) if p is None else p.reshape(r, 1).long()
        for cache, r, p in zip(caches, rows, given, strict=True)
    ]).to(states.device)  # (sum rows, 1)  # fmt: skip
    bool_masks = None if masks is None else [None if m is None else m.to(states.device).bool() for m in masks]
    kinds = span.layer_kinds[start:end]
    rotaries = {  # each kind once: every layer of a kind gets the same
        kind: span.family.position_embeddings(span.rotary, states, position_ids, kind) for kind in dict.fromkeys(kinds)
    }
    window = getattr(span.config, "sliding_window", None)
    windows = {start + i: window if kind == SLIDING_ATTENTION else None for i, kind in enumerate(kinds)}
    batch = SessionCaches(caches, rows, windows, bool_masks, eager=span.family.eager_attention)
    states = _through_layers(span, states, position_ids, rotaries, batch, start, end)
    return list(torch.split(states, rows))


def prefill_batched(
    span: SpanModel, hidden: Sequence[torch.Tensor], caches: Sequence[DynamicCache], start: int, end: int,
    adapter: str | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """hidden[i] (1, tokens_i, hidden) is the prompt of the session owning caches[i], which holds nothing yet over
    blocks [start, end); returns each session's output (1, tokens_i, hidden), as if it had run alone (a causal
    forward over its own tokens at positions 0..tokens_i - 1, without padding), and fills its own cache. The prompts
    run as one sequence through the projections and MLPs (their weights are read once for all), and attention runs
    prompt by prompt. A sliding-window layer is not handled: each prompt must fit in the window. All sessions use
    the same LoRA adapter (None: the base model)."""
    span.use_adapter(adapter)
    tokens = [h.shape[1] for h in hidden]
    if any(h.shape[0] != 1 for h in hidden) or any(c.get_seq_length(start) for c in caches):
        raise ValueError("prefill_batched takes one row per session and sessions with nothing cached")
    states = torch.cat(list(hidden), dim=1)  # (1, sum tokens, hidden)
    position_ids = torch.cat([torch.arange(count) for count in tokens]).unsqueeze(0).to(states.device)
    kinds = span.layer_kinds[start:end]
    window = getattr(span.config, "sliding_window", None)
    if window is not None and SLIDING_ATTENTION in kinds and max(tokens) > window:
        raise ValueError(f"a prompt longer than the sliding window ({window}) runs alone")
    rotaries = {
        kind: span.family.position_embeddings(span.rotary, states, position_ids, kind) for kind in dict.fromkeys(kinds)
    }
    batch = SessionCaches(caches, [1] * len(caches), {}, None, tokens, span.family.eager_attention)
    states = _through_layers(span, states, position_ids, rotaries, batch, start, end)
    return list(torch.split(states, tokens, dim=1))


def _through_layers(
    span: SpanModel, states: torch.Tensor, position_ids: torch.Tensor, rotaries: dict[str, Any], batch: SessionCaches,
    start: int, end: int,
) -> torch.Tensor:  # fmt: skip
    """states through blocks [start, end), each layer's attention going session by session (sessions_attention)."""
    kinds = span.layer_kinds[start:end]
    config = span.config
    usual = config._attn_implementation
    config._attn_implementation = SESSIONS_ATTENTION  # the compute thread is the span's only user meanwhile
    try:
        for layer, kind in zip(span.layers[start - span.start : end - span.start], kinds, strict=True):
            states = layer(
                states,
                attention_mask=None,
                position_ids=position_ids,
                cache=batch,
                use_cache=True,
                position_embeddings=rotaries[kind],
                sessions=batch,
            )
    finally:
        config._attn_implementation = usual
    return states
