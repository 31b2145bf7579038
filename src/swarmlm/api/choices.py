"""What one choice of a request is made of: its sampling parameters, the choice of each next token, and its text as
the tokens arrive (held back at a possible stop string or a partial character)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from swarmlm.api.sampling import LogitRules, filtered_probs


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int  # tokens generated per choice at most
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling: smallest set of tokens whose probability reaches top_p
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    seed: int | None = None  # same seed, same request: same text
    n: int = 1  # choices, generated as the rows of one session
    logprobs: int | None = None  # None: no log-probabilities; k: each token's, with its k most likely alternatives
    rules: LogitRules = LogitRules()  # logit_bias, penalties, top_k, min_p
    grammar: str | None = None  # llguidance grammar every choice must follow (api/grammar.py); None: free text


class ChoiceText:
    """The text of one choice as its tokens arrive: held back while it may still turn into a stop string or ends
    inside a multi-byte character; cut before the first stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], eos_ids: frozenset[int]):
        self.tokenizer, self.stop, self.eos_ids = tokenizer, stop, eos_ids
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the text already handed out
        self.decoded = 0  # characters of the whole text decoded so far (where the next token's text begins)
        self.finish_reason: str | None = None

    def add(self, token: int) -> str:
        """Text newly safe to hand out after `token` (sets finish_reason when the choice ends)."""
        self.tokens.append(token)
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return self._flush(self._text())
        text = self._text()
        search_from = max(0, self.emitted - self.hold)
        cuts = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if cuts:
            self.finish_reason = "stop"
            return self._flush(text[: min(cuts)])
        if text.endswith("\ufffd"):  # the last token ends inside a character: wait for the rest
            return ""
        safe = max(self.emitted, len(text) - self.hold)
        new, self.emitted = text[self.emitted : safe], safe
        return new

    def finish(self, reason: str) -> str:
        self.finish_reason = reason
        return self._flush(self._text())

    def _text(self) -> str:
        text: str = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.decoded = len(text)
        return text

    def _flush(self, text: str) -> str:
        new, self.emitted = text[self.emitted :], len(text)
        return new


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """(rows, vocab) logits (bias and penalties applied) -> (rows,) token ids: argmax at temperature 0, else sampled
    after min_p, top_k and top_p (api/sampling.py)."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = filtered_probs(logits, params.temperature, params.top_p, params.rules)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
