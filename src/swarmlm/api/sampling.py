"""The sampling rules a request may set, applied to a step's logits: logit_bias and the penalties before the choice
(so greedy decoding sees them too), then min_p, top_k and top_p on the distribution that is sampled.

The order is vLLM's: bias, repetition penalty, frequency and presence penalties, then (unless greedy) temperature,
min_p, top_k, top_p. The penalties follow OpenAI's documented rule over the tokens generated so far,
`logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`, and the repetition penalty is the
one of Hugging Face and vLLM over the prompt and the generated tokens: a positive logit divided by it, a negative one
multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitRules:
    """What a request asks of its logits besides temperature and top_p; the defaults change nothing."""

    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per time a token was generated so far
    repetition_penalty: float = 1.0  # > 1 discourages the tokens of the prompt and of the text so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    top_k: int = 0  # sample among the k likeliest tokens only; 0 (or -1, as vLLM says it): all
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one

    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class Penalties:
    """The state the rules read per row of a generation: how often each token was generated so far, and which
    tokens the prompt or the generated text hold."""

    def __init__(self, rules: LogitRules, prompt: list[int], rows: int, vocab: int):
        self.rules = rules
        self.counts = torch.zeros(rows, vocab)  # (rows, vocab): times each token was generated
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool)  # (rows, vocab): in the prompt or generated
        if prompt:
            self.seen[:, torch.tensor(prompt)] = True
        self.bias: torch.Tensor | None = None  # (vocab,)
        if rules.logit_bias:
            self.bias = torch.zeros(vocab)
            tokens, values = zip(*rules.logit_bias, strict=True)
            self.bias[list(tokens)] = torch.tensor(values)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) logits -> the same with the bias and the penalties applied (a new float32 tensor)."""
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias.to(logits.device)
        if not self.rules.penalizes():
            return logits
        counts, seen = self.counts.to(logits.device), self.seen.to(logits.device)
        penalty = self.rules.repetition_penalty
        if penalty != 1.0:
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        return logits - counts * self.rules.frequency_penalty - (counts > 0).float() * self.rules.presence_penalty

    def add(self, chosen: torch.Tensor) -> None:
        """Count the tokens (rows,) just generated."""
        rows = torch.arange(len(chosen))
        self.counts[rows, chosen.cpu()] += 1
        self.seen[rows, chosen.cpu()] = True


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float, rules: LogitRules) -> torch.Tensor:
    """(rows, vocab) logits -> the probabilities to sample from, (rows, vocab), unnormalized where tokens were
    dropped: softmax at `temperature`, then min_p, top_k and top_p (each keeps at least the likeliest token)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if rules.min_p > 0.0:
        floor = rules.min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    if 0 < rules.top_k < probs.shape[-1]:
        kth = probs.topk(rules.top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        if rules.min_p > 0.0 or rules.top_k > 0:  # top_p reads the distribution that min_p and top_k left
            probs = probs / probs.sum(-1, keepdim=True)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the tokens before it sum to less than top_p (the first one always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs
