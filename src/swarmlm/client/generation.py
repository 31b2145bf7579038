"""Generation through server-side KV caches: explicit inference sessions; generate() feeds only new tokens."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarmlm.client import trace
from swarmlm.client.head_batching import HeadBatcher, LoopHeadBatcher
from swarmlm.client.inference import InferenceSession
from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.speculative import DraftModel, PromptLookup, Proposer, speculative_generate
from swarmlm.errors import SessionClosedError

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    from swarmlm.client.lora import LoraTuning
    from swarmlm.client.prompts import PromptTuning
    from swarmlm.models.registry import ModelFamily
    from swarmlm.protocol.lora import LoraWeights

    class _ModelBase(PreTrainedModel, GenerationMixin):
        """The mixins are only ever mixed into a Hugging Face causal LM class: its attributes and generate()."""

else:
    _ModelBase = object

# new tokens generate() makes when neither max_new_tokens nor max_length says otherwise (Hugging Face's default)
DEFAULT_MAX_NEW_TOKENS = 20
# tokens a draft model proposes per round when generate() is not given num_assistant_tokens
DEFAULT_DRAFT_TOKENS = 5


class GenerationSession(InferenceSession):
    """A session over all of a model's blocks (model.inference_session()), with what generation knows of its tokens:
    the ids the model's forward has processed, and the last generate()'s output. Rolling the session back (setting
    `position`) cuts them too."""

    def __init__(
        self, manager: SequenceManager, loop: LoopThread, start: int, end: int, max_length: int,
        active: list[InferenceSession] | None = None, on_trace: Callable[[trace.RequestTrace], None] | None = None,
        prefix_tokens: int = 0,
    ):  # fmt: skip
        super().__init__(manager, loop, start, end, max_length, active, on_trace)
        self.prefix_tokens = prefix_tokens  # positions taken by a model's prompt-tuning prefix before its first token
        self.token_ids: torch.Tensor | None = None  # (batch, tokens) ids the model's forward has processed
        self.output_ids: torch.Tensor | None = None  # (batch, tokens) the last generate()'s sequences
        self.output_mask: torch.Tensor | None = None  # (batch, tokens) attention mask of output_ids

    def _rolled_back(self, tokens: int) -> None:
        keep = max(tokens - self.prefix_tokens, 0)
        if self.token_ids is not None:
            self.token_ids = self.token_ids[:, :keep]
        if self.output_ids is not None:
            self.output_ids = self.output_ids[:, :keep]
        if self.output_mask is not None:
            self.output_mask = self.output_mask[:, :keep]


def generating(session: InferenceSession) -> GenerationSession:
    """The session as one that generation can run in (a model's, which knows its token ids; not a slice's)."""
    if not isinstance(session, GenerationSession):
        raise TypeError(
            f"generation runs in a session of the model (model.inference_session(...)), not one of blocks "
            f"{session.start}:{session.end} alone (model.model.layers...inference_session(...))"
        )
    return session


def new_tokens(session: GenerationSession, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(ids the session has not processed, hypo_ids reordering its rows to match input_ids or None, ids processed).

    When input_ids holds nothing new, the session is rolled back by one token so that its logits can be recomputed.
    """
    if session.position == 0:
        return input_ids, None, 0
    seen_ids = session.token_ids
    if seen_ids is None or session.position != session.prefix_tokens + seen_ids.shape[1]:
        raise ValueError(
            f"the session holds {session.position} positions that are not all token ids given to this model "
            "(stepped by hand, or rolled back into the prompt prefix): open a new session"
        )
    seen = seen_ids.shape[1]
    if input_ids.shape[1] < seen:
        raise ValueError(f"the session has processed {seen} tokens; give inputs that continue them")
    if input_ids.shape[1] == seen:  # nothing new: recompute the last token to get its logits
        seen -= 1
        session.position -= 1
        seen_ids = seen_ids[:, :seen]
        if session.position == 0:
            return input_ids, None, 0
    # each row continues some row the session has seen (beam search reorders and duplicates rows)
    same = (input_ids[:, None, :seen] == seen_ids[None, :, :]).all(-1)  # (batch, previous batch)
    if not same.any(-1).all():
        raise ValueError("the inputs do not continue this inference session's tokens: open a new session")
    hypo_ids = same.int().argmax(-1)
    identity = seen == 0 or torch.equal(hypo_ids, torch.arange(len(hypo_ids)))
    return input_ids[:, seen:], None if identity else hypo_ids, seen


def _continues(inputs: torch.Tensor, previous: torch.Tensor) -> bool:
    """Whether inputs are a whole sequence that starts with the session's previous output (Hugging Face style)."""
    return (
        inputs.shape[0] == previous.shape[0]
        and inputs.shape[1] >= previous.shape[1]
        and torch.equal(inputs[:, : previous.shape[1]], previous)
    )


class SessionStacks(threading.local):
    """Each thread's own stack of the sessions open in `with` blocks: threads sharing a model never pick up each
    other's sessions."""

    def __init__(self) -> None:
        self.stack: list[InferenceSession] = []


class RemoteGenerationMixin(_ModelBase):
    """Hugging Face generate() on top of InferenceSession; mixed into the distributed causal LM classes."""

    _session_stacks: SessionStacks
    _head_batcher: HeadBatcher
    _loop_heads: LoopHeadBatcher

    @property
    def _active_sessions(self) -> list[InferenceSession]:
        return self._session_stacks.stack

    if TYPE_CHECKING:  # set by DistributedCausalLMMixin, and the HF decoder of the class mixed into
        family: ModelFamily
        prompt_tuning: PromptTuning | None
        lora_tuning: LoraTuning | None
        model: Any  # the family's decoder: embeddings, rotary_emb, norm, and layers (a RemoteSequential)

    def inference_session(self, max_length: int) -> GenerationSession:
        """A session over all blocks holding up to max_length tokens (prompt included). generate(session=...) uses
        it; so does generate() inside `with model.inference_session(...)`. model(...) never does."""
        blocks, prefix = self.model.layers, 0 if self.prompt_tuning is None else self.prompt_tuning.pre_seq_len
        client = blocks.client
        if client.closed:
            raise SessionClosedError("this model's swarm connection is closed")
        return GenerationSession(
            client.manager, client.loop, blocks.start, blocks.end, max_length + prefix, self._active_sessions,
            on_trace=client.keep_trace, prefix_tokens=prefix,
        )  # fmt: skip

    @property
    def active_session(self) -> InferenceSession | None:
        """The innermost session of this model open in a `with` block of this thread (generate()'s own one while
        it runs)."""
        return self._active_sessions[-1] if self._active_sessions else None

    def generate(
        self, inputs: torch.Tensor | None = None, *args: Any, session: InferenceSession | None = None, **kwargs: Any
    ) -> Any:
        """transformers' generate() with the KV caches on the servers, in `session`, the active session, or a new one.

        In a session that has generated before, inputs=None continues its last output, and inputs that do not
        start with that output are new tokens appended to it; then only what is new is returned (as in Petals).
        """
        kwargs["use_cache"] = False  # no local cache: each forward gets the whole sequence, and sends what is new
        if inputs is None:
            inputs = kwargs.pop("input_ids", None)
        session = session if session is not None else self.active_session
        if session is not None:
            return self._generate_in(session, inputs, args, kwargs)
        if inputs is None:
            raise ValueError("generate() needs input_ids")
        new = kwargs.get("max_new_tokens") or self.generation_config.max_new_tokens
        if new is None and kwargs.get("max_length"):
            new = kwargs["max_length"] - inputs.shape[1]
        with self.inference_session(max_length=inputs.shape[1] + (new or DEFAULT_MAX_NEW_TOKENS)) as session:
            return self._generate_in(session, inputs, args, kwargs)

    def _generate_in(
        self, session: InferenceSession, inputs: torch.Tensor | None, args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        session = generating(session)
        previous, skipped = session.output_ids, 0
        if previous is not None and previous.shape[1] > 0 and (inputs is None or not _continues(inputs, previous)):
            appended = 0 if inputs is None else inputs.shape[1]
            inputs = previous if inputs is None else torch.cat([previous, inputs.to(previous.device)], dim=1)
            mask = kwargs.get("attention_mask")
            if session.output_mask is not None or mask is not None:
                old = session.output_mask if session.output_mask is not None else torch.ones_like(previous)
                new = mask if mask is not None else torch.ones(len(previous), appended, dtype=old.dtype)
                kwargs["attention_mask"] = torch.cat([old, new.to(old.device, old.dtype)], dim=1)
            skipped = previous.shape[1]
        elif inputs is None:
            raise ValueError("generate() needs input_ids: the session has no output to continue")
        # the model's last_trace after generate() tells every step of it (retries and replays included)
        session.generation_trace = trace.RequestTrace("generate")
        try:
            if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
                result = self._speculative_generate(session, inputs, args, kwargs)
            else:
                result = super().generate(inputs, *args, session=session, **kwargs)
        finally:
            session.generation_trace = None
        sequences = result if isinstance(result, torch.Tensor) else result.sequences  # a tensor or a ModelOutput
        session.output_ids, session.output_mask = sequences, None
        mask = kwargs.get("attention_mask")
        if mask is not None and len(mask) == len(sequences):
            extra = torch.ones(len(mask), sequences.shape[1] - mask.shape[1], dtype=mask.dtype, device=mask.device)
            session.output_mask = torch.cat([mask, extra], dim=1)
        if skipped:
            if isinstance(result, torch.Tensor):
                result = sequences[:, skipped:]
            else:
                result.sequences = sequences[:, skipped:]
        return result

    def _speculative_generate(
        self, session: GenerationSession, inputs: torch.Tensor, args: tuple, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """Greedy generate() with proposals checked several at a time (client/speculative.py): the draft model of
        `assistant_model` (num_assistant_tokens a round, default 5), or else prompt lookup of
        prompt_lookup_num_tokens tokens. The output is that of plain greedy decoding."""
        options = dict(kwargs)
        draft = options.pop("assistant_model", None)
        lookup = options.pop("prompt_lookup_num_tokens", None)
        lookahead = options.pop("num_assistant_tokens", None) or (lookup if draft is None else DEFAULT_DRAFT_TOKENS)
        streamer = options.pop("streamer", None)
        max_new, max_length = options.pop("max_new_tokens", None), options.pop("max_length", None)
        eos = options.pop("eos_token_id", None)
        min_new = options.pop("min_new_tokens", None) or 0
        mask = options.pop("attention_mask", None)
        options.pop("use_cache", None)
        options.pop("pad_token_id", None)
        if options.pop("do_sample", False) or options.pop("num_beams", 1) != 1:
            raise ValueError("speculative decoding (assistant_model / prompt_lookup_num_tokens) is greedy only: "
                             "leave do_sample and num_beams at their defaults")  # fmt: skip
        if args or options:
            raise ValueError(
                f"speculative decoding does not take {sorted(options) or 'positional options'}; it takes "
                "max_new_tokens, min_new_tokens, max_length, eos_token_id, pad_token_id, attention_mask (all ones), "
                "streamer, num_assistant_tokens"
            )
        if mask is not None and not bool(mask.all()):
            raise ValueError("speculative decoding runs one unpadded sequence: the attention mask must be all ones")
        config = self.generation_config
        if max_new is None:
            max_new = config.max_new_tokens
        if max_new is None:
            max_new = (max_length or config.max_length or 0) - inputs.shape[1]
        eos = config.eos_token_id if eos is None else eos
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        proposer: Proposer = PromptLookup() if draft is None else DraftModel(draft)

        def forward(session: GenerationSession, input_ids: torch.Tensor) -> torch.Tensor:
            return cast(torch.Tensor, self._session_forward(session, input_ids, None, None).logits)

        return speculative_generate(forward, session, inputs, proposer, lookahead, max_new, eos_ids, streamer, min_new)

    def _session_forward(
        self,
        session: InferenceSession,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> CausalLMOutputWithPast:
        """A forward through `session`: tokens it has not processed run through the servers' caches; their logits
        (of the last logits_to_keep of them; 0: all)."""
        session = generating(session)
        step = self._session_step(session, input_ids, attention_mask, position_ids)
        out = session.step(
            step.embeds, step.prompts, step.hypo_ids, attention_mask=step.attention_mask,
            position_ids=step.position_ids, lora=step.lora,
        )  # fmt: skip
        hidden = self._after_step(session, step, input_ids, out)
        hidden = hidden[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]
        head = self.get_submodule(self.family.head_name)
        # without gradients (generation), concurrent callers' rows share one product (client/head_batching.py)
        logits = self._head_batcher(head, hidden) if not torch.is_grad_enabled() else head(hidden)
        return CausalLMOutputWithPast(logits=self.family.final_logits(self.config, logits))

    async def anext_logits(self, session: InferenceSession, input_ids: torch.Tensor) -> torch.Tensor:
        """On the client's loop (await it there; it never blocks the loop on the LM head): the logits (batch,
        vocab) of input_ids' last position, running the tokens `session` has not processed through its servers.

        What a generation loop needs per token, for callers that run many generations as coroutines on one loop
        (the API server's requests): their LM heads run as one product on a worker thread, gathered from every
        generation of this model whose step comes back at about the same time (client/head_batching.py)."""
        hidden = await self.anext_hidden(session, input_ids)
        return await self.ahead_logits(hidden[:, -1])

    async def anext_hidden(self, session: InferenceSession, input_ids: torch.Tensor) -> torch.Tensor:
        """On the client's loop: the final-norm hidden states (batch, new tokens, hidden) of the tokens of input_ids
        that `session` has not processed, run through its servers in one step. A caller that scores every position
        (a prompt's log-probabilities) puts them through ahead_logits a slice at a time."""
        session = generating(session)
        with torch.inference_mode():
            step = self._session_step(session, input_ids, None, None)
            inputs = session.inputs(
                step.embeds, step.prompts, step.hypo_ids, attention_mask=step.attention_mask,
                position_ids=step.position_ids, lora=step.lora,
            )  # fmt: skip
        self._loop_heads.stepping += 1
        try:
            out = await session.atraced_step(inputs)
        finally:
            self._loop_heads.stepping -= 1
        with torch.inference_mode():
            return self._after_step(session, step, input_ids, out)

    async def ahead_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """On the client's loop: the logits (rows, vocab) of final-norm hidden states (rows, hidden), by the LM head
        shared with the other generations on this loop."""
        logits = await self._loop_heads(hidden)
        return self.family.final_logits(self.config, logits)

    def _head_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head of (rows, hidden), by the model's head batcher (its packed weight); on a worker thread."""
        with torch.inference_mode():
            return self._head_batcher(self.get_submodule(self.family.head_name), rows)

    def _session_step(
        self,
        session: GenerationSession,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> _Step:
        """What a forward through `session` sends for the tokens it has not processed: their embeddings (after the
        prompt's, on a session's first step), deep prompts and LoRA weights on the first step, the mask and
        positions."""
        new_ids, hypo_ids, seen = new_tokens(session, input_ids)
        fresh = session.position == 0
        embeds = self.get_submodule(self.family.embed_name)(new_ids)
        if position_ids is not None:
            position_ids = position_ids[:, seen:]
        tuning, prompts = self.prompt_tuning, None
        if tuning is not None and fresh:
            # the first step carries the prompt: its embeddings in front, its deep prompts to the servers
            embeds, attention_mask, position_ids = tuning.extend(embeds, attention_mask, position_ids)
            prompts = None if tuning.deep_prompts is None else tuning.deep_prompts.detach()
        elif tuning is not None:
            # the mask covers the whole sequence, prompt included; new positions come after the prompt
            attention_mask = tuning.extend_mask(attention_mask)
            position_ids = None if position_ids is None else position_ids + tuning.pre_seq_len
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        lora = None
        if self.lora_tuning is not None and fresh:
            # the session keeps the LoRA weights of its first step (the model's current ones) for all its steps
            lora = self.lora_tuning.weights()
        prefix = tuning.pre_seq_len if tuning is not None and fresh else 0
        return _Step(embeds, prompts, hypo_ids, attention_mask, position_ids, lora, prefix)

    def _after_step(
        self, session: GenerationSession, step: _Step, input_ids: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The step's output through the final norm, without the prompt's positions; the session records that it
        has processed input_ids."""
        session.token_ids = input_ids
        hidden = self.get_submodule(self.family.norm_name)(hidden.to(step.embeds.device, step.embeds.dtype))
        return hidden[:, step.prefix :]


@dataclass(frozen=True)
class _Step:
    """A generation step's arguments to the session, and the prompt positions to drop from its output."""

    embeds: torch.Tensor  # (batch, new tokens, hidden), after the prompt's on a prompt-tuned session's first step
    prompts: torch.Tensor | None  # deep prompts (first step only)
    hypo_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    lora: LoraWeights | None  # the model's LoRA weights (first step only)
    prefix: int  # the prompt's positions in front of the tokens (a prompt-tuned session's first step), dropped
