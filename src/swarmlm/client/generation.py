"""Generation through server-side KV caches: inference_session() and a generate() that feeds only new tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarmlm.client.inference import InferenceSession
from swarmlm.protocol.bundle import SpanTensors

# new tokens generate() makes when neither max_new_tokens nor max_length says otherwise (Hugging Face's default)
DEFAULT_MAX_NEW_TOKENS = 20


class SessionTokens:
    """An inference session and the token ids it has processed, to feed each forward only the tokens it lacks."""

    def __init__(self, session: InferenceSession):
        self.session = session
        self.token_ids: torch.Tensor | None = None  # (batch, seen)

    def new_tokens(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(ids the session has not seen, hypo_ids reordering its rows to match input_ids or None, seen count)."""
        if self.token_ids is None:
            return input_ids, None, 0
        seen = self.token_ids.shape[1]
        if input_ids.shape[1] <= seen:
            raise ValueError(f"the session has processed {seen} tokens; give inputs that continue them")
        # each row continues some row the session has seen (beam search reorders and duplicates rows)
        same = (input_ids[:, None, :seen] == self.token_ids[None, :, :]).all(-1)  # (batch, previous batch)
        if not same.any(-1).all():
            raise ValueError("the inputs do not continue this inference session's tokens: open a new session")
        hypo_ids = same.int().argmax(-1)
        identity = torch.equal(hypo_ids, torch.arange(len(hypo_ids)))
        return input_ids[:, seen:], None if identity else hypo_ids, seen


class RemoteGenerationMixin:
    """Hugging Face generate() on top of InferenceSession; mixed into the distributed causal LM classes."""

    _session: SessionTokens | None = None

    @contextlib.contextmanager
    def inference_session(self, max_length: int) -> Iterator[InferenceSession]:
        """A session holding up to max_length tokens (prompt included); generate() inside it continues it."""
        if self._session is not None:
            raise RuntimeError("an inference session is already open on this model")
        blocks = self.model.layers
        prefix = 0 if self.prompt_tuning is None else self.prompt_tuning.pre_seq_len
        session = InferenceSession(blocks.client.manager, blocks.start, blocks.end, max_length + prefix)
        self._session = SessionTokens(session)
        try:
            yield session
        finally:
            self._session = None
            blocks.client.loop.run(session.close())

    def generate(self, inputs: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        """transformers' generate(); the KV caches live on the servers, in this model's (or a new) session."""
        kwargs["use_cache"] = False  # no local cache: each forward gets the whole sequence, and sends what is new
        if self._session is not None:
            return super().generate(inputs, *args, **kwargs)
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("generate() needs input_ids")
        config = self.generation_config
        new_tokens = kwargs.get("max_new_tokens") or config.max_new_tokens
        if new_tokens is None and kwargs.get("max_length"):
            new_tokens = kwargs["max_length"] - input_ids.shape[1]
        max_length = input_ids.shape[1] + (new_tokens or DEFAULT_MAX_NEW_TOKENS)
        with self.inference_session(max_length=max_length):
            return super().generate(inputs, *args, **kwargs)

    def _session_forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> CausalLMOutputWithPast:
        """A forward inside a session: the tokens it has not seen go through the servers' caches; logits of those."""
        state = self._session
        new_ids, hypo_ids, seen = state.new_tokens(input_ids)
        embeds = self.get_submodule(self.family.embed_name)(new_ids)
        if position_ids is not None:
            position_ids = position_ids[:, seen:]
        tuning, prompts = self.prompt_tuning, None
        if tuning is not None and seen == 0:
            # the first step carries the prompt: its embeddings in front, its deep prompts to the servers
            embeds, attention_mask, position_ids = tuning.extend(embeds, attention_mask, position_ids)
            prompts = None if tuning.deep_prompts is None else tuning.deep_prompts.detach()
        elif tuning is not None:
            # the mask covers the whole sequence, prompt included; new positions come after the prompt
            attention_mask = tuning.extend_mask(attention_mask)
            position_ids = None if position_ids is None else position_ids + tuning.pre_seq_len
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        inputs = SpanTensors(
            embeds.detach().cpu(), attention_mask=attention_mask, position_ids=position_ids, hypo_ids=hypo_ids,
            prompts=prompts,
        )  # fmt: skip
        blocks = self.model.layers
        hidden = blocks.client.loop.run(state.session.step(inputs))
        state.token_ids = input_ids
        hidden = self.get_submodule(self.family.norm_name)(hidden.to(embeds.dtype))
        if tuning is not None and seen == 0:
            hidden = hidden[:, tuning.pre_seq_len :]
        return CausalLMOutputWithPast(logits=self.get_submodule(self.family.head_name)(hidden))
