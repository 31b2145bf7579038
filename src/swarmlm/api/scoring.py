"""Log-probabilities of tokens under the model: a step's chosen tokens with their likeliest alternatives, and a
whole prompt's tokens (completions' echo) from its hidden states, a slice of positions at a time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

# prompt positions whose logits are computed at once for their log-probabilities (echo): 128 x a 49k vocabulary is
# 25 MB of float32, whatever the prompt's length
PROMPT_SCORE_POSITIONS = 128


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (its logits' log-softmax, whatever the temperature),
    and the most likely tokens at its place, most likely first."""

    token: int
    logprob: float | None  # None for a prompt's first token, which nothing before it predicts
    top: tuple[tuple[int, float], ...]  # (token, log-probability)
    text_offset: int  # characters of the choice's text before this token


def token_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, top: int | None
) -> list[tuple[float, tuple[tuple[int, float], ...]]] | None:
    """Per row of (rows, vocab) logits: the chosen token's log-probability and the `top` most likely (token,
    log-probability), most likely first; None when top is None (not asked for). The model's distribution, before
    temperature and top_p (which only shape the sampling)."""
    if top is None:
        return None
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (rows, vocab)
    picked = logprobs.gather(-1, chosen[:, None].to(logprobs.device))[:, 0].tolist()
    best = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1) if top else None  # sorted, most likely first
    rows = []
    for row, logprob in enumerate(picked):
        alternatives = (
            () if best is None else tuple(zip(best.indices[row].tolist(), best.values[row].tolist(), strict=True))
        )
        rows.append((logprob, alternatives))
    return rows


async def prompt_logprobs(
    head: Callable[[torch.Tensor], Awaitable[torch.Tensor]],
    prompt: list[int],
    hidden: torch.Tensor,
    top: int,
    offsets: tuple[int, ...],
) -> tuple[TokenLogprob, ...]:
    """Each prompt token's log-probability given the tokens before it (the first has none), with its `top` most
    likely alternatives, from the prompt's final-norm hidden states (prompt, hidden) and the LM head `head` ((rows,
    hidden) -> (rows, vocab) logits), PROMPT_SCORE_POSITIONS at a time."""
    entries = [TokenLogprob(prompt[0], None, (), offsets[0])]
    for start in range(0, len(prompt) - 1, PROMPT_SCORE_POSITIONS):
        end = min(start + PROMPT_SCORE_POSITIONS, len(prompt) - 1)
        logits = await head(hidden[start:end])  # (end - start, vocab): of tokens start+1..end
        with torch.inference_mode():
            rows = token_logprobs(logits, torch.tensor(prompt[start + 1 : end + 1]), top) or []
        entries += [TokenLogprob(prompt[place], logprob, alternatives, offsets[place])
                    for place, (logprob, alternatives) in enumerate(rows, start + 1)]  # fmt: skip
    return tuple(entries)
