"""Speculative decoding through an inference session: a draft proposes tokens, the swarm checks them in one step.

Each round sends the last accepted token and k proposed ones to the servers as one step. The logits of those k + 1
positions give the model's own greedy choice after each of them; the longest run of proposals that agree with it is
kept, plus the model's choice after that run, so the output is the plain greedy output. The session is then rolled
back (`session.position`) to drop the rejected proposals from the servers' caches. With a good draft one round
costs one network round trip per route instead of one per token.

Proposals come from a local draft model (`assistant_model=`, any Hugging Face causal LM sharing the tokenizer) or,
with no draft, from prompt lookup (`prompt_lookup_num_tokens=`): the tokens that followed the latest earlier
occurrence of the sequence's last n-gram (useful when the output copies its input: summaries, code edits, RAG).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from transformers.generation.streamers import BaseStreamer

    from swarmlm.client.generation import GenerationSession

# the n-gram sizes prompt lookup tries, longest first (as in transformers' prompt lookup)
MAX_NGRAM = 3


class Proposer(Protocol):
    def propose(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        """Up to `count` tokens likely to follow ids (1, length), as a 1-D tensor (possibly empty)."""
        ...


class PromptLookup:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's last n-gram."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram

    def propose(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        row = ids[0]
        length = len(row)
        for size in range(min(self.max_ngram, length - 1), 0, -1):
            tail = row[length - size :]
            windows = row.unfold(0, size, 1)[: length - size]  # every earlier n-gram, not the tail itself
            hits = (windows == tail).all(-1).nonzero().flatten()
            for start in reversed(hits.tolist()):  # the latest occurrence that has something after it
                follow = row[start + size : start + size + count]
                if len(follow):
                    return follow
        return row[:0]


class DraftModel:
    """Greedy proposals of a small local causal LM, which keeps its own KV cache between rounds."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache: Any = None
        self.seen: torch.Tensor | None = None  # the ids the draft's cache holds

    @torch.inference_mode()
    def propose(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        if count <= 0:
            return ids[0, :0]
        device = ids.device
        ids = ids.to(next(self.model.parameters()).device)
        keep = 0
        if self.seen is not None and self.cache is not None:
            common = min(len(self.seen[0]), ids.shape[1] - 1)  # always feed at least one token
            same = (self.seen[0, :common] == ids[0, :common]).int()
            keep = int(same.cumprod(0).sum())
        if keep == 0:
            self.cache = None
        elif self.cache.get_seq_length() > keep:
            self.cache.crop(keep - self.cache.get_seq_length())  # a negative count removes that many tokens
        proposed: list[torch.Tensor] = []
        feed = ids[:, keep:]
        for _ in range(count):
            out = self.model(input_ids=feed, cache=self.cache, use_cache=True)
            self.cache = out.cache
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            proposed.append(token[0])
            feed = token
        self.seen = torch.cat([ids, torch.cat(proposed[:-1])[None]], dim=1) if len(proposed) > 1 else ids
        return torch.cat(proposed).to(device)


class SessionForward(Protocol):
    def __call__(self, session: GenerationSession, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (1, new tokens, vocab) of the tokens the session has not processed yet."""
        ...


def speculative_generate(
    forward: SessionForward,
    session: GenerationSession,
    input_ids: torch.Tensor,
    proposer: Proposer,
    lookahead: int,
    max_new_tokens: int,
    eos_token_ids: list[int],
    streamer: BaseStreamer | None = None,
    min_new_tokens: int = 0,
) -> torch.Tensor:
    """Greedy decoding of up to max_new_tokens tokens after input_ids (1, length), checked `lookahead` proposals at a
    time; stops after an end-of-sequence token (never one of the first min_new_tokens). Returns the whole sequence,
    as generate() does."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding runs one sequence at a time, got a batch of {input_ids.shape[0]}")
    if lookahead < 1:
        raise ValueError(f"the number of proposed tokens must be >= 1, got {lookahead}")
    ids, made = input_ids, 0
    eos = torch.tensor(eos_token_ids, dtype=ids.dtype)
    if streamer is not None:
        streamer.put(ids.cpu())  # the prompt first, as generate() does
    while made < max_new_tokens:
        # the last token of a round is output without being processed: proposals may use the rest of the budget
        proposals = proposer.propose(ids, min(lookahead, max_new_tokens - made - 1)).to(ids.dtype)
        candidate = torch.cat([ids, proposals[None]], dim=1)
        logits = forward(session, candidate)
        scores = logits[0, -len(proposals) - 1 :]
        early = min_new_tokens - made  # before min_new_tokens, end-of-sequence is never chosen (as in generate())
        if early > 0 and eos_token_ids:
            scores = scores.clone()
            scores[:early, eos_token_ids] = float("-inf")
        chosen = scores.argmax(-1).to(ids.dtype)  # the model's token after each position
        agree = (chosen[:-1] == proposals).int().cumprod(0)
        accepted = int(agree.sum())
        new = chosen[: accepted + 1]  # the agreeing proposals are the model's own choices, then its next token
        stops = torch.isin(new, eos).nonzero()
        if len(stops):
            new = new[: int(stops[0]) + 1]
        new = new[: max_new_tokens - made]
        # the servers hold every candidate; keep only the accepted ones (the last new token is not processed yet)
        processed = ids.shape[1] + len(new) - 1
        if session.token_ids is not None and session.token_ids.shape[1] > processed:
            session.position = session.prefix_tokens + processed
            session.token_ids = candidate[:, :processed]
        ids = torch.cat([ids, new[None]], dim=1)
        made += len(new)
        if streamer is not None:
            streamer.put(new.cpu())
        if len(stops):
            break
    if streamer is not None:
        streamer.end()
    return ids
