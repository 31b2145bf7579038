"""The completions endpoint's prompts: text or token ids, one or a list of them, each run as its own generation and
merged into one answer (prompt i's choice j is choice i * n + j, as OpenAI numbers them); echo's text and offsets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence

from swarmlm.api.engine import Delta, Echo, Engine, Usage
from swarmlm.api.logprobs import TokenNames
from swarmlm.api.sampling import LogitRules
from swarmlm.api.schemas import ApiError

_DONE = object()


def vocab_size(engine: Engine) -> int:
    """The token ids the model's embeddings and LM head know: 0 to vocab_size - 1."""
    return int(engine.model.config.vocab_size)


def prompt_ids(engine: Engine, prompt: str | list[int], index: int) -> list[int]:
    """A prompt's token ids: a text's tokens, or the ids as given once each is checked to be the model's."""
    if isinstance(prompt, str):
        return engine.text_prompt(prompt)
    vocab = vocab_size(engine)
    for token in prompt:
        if not 0 <= token < vocab:
            raise ApiError(400, f"'prompt' holds token id {token} (prompt {index}); this model's ids are 0 to "
                                f"{vocab - 1}", param="prompt")  # fmt: skip
    return prompt


def echo_of(prompt: str | list[int], ids: list[int], names: TokenNames) -> Echo:
    """What echo repeats of a prompt: the text as sent (token ids: their text), and where each token's text begins,
    counted as the tokens' texts in the reply's `tokens` add up."""
    offsets, place = [], 0
    for token in ids:
        offsets.append(place)
        place += len(names.text_of(token))
    text = prompt if isinstance(prompt, str) else "".join(names.text_of(token) for token in ids)
    return Echo(text, tuple(offsets))


def check_bias(rules: LogitRules, engine: Engine) -> None:
    """logit_bias may name only the model's token ids."""
    vocab = vocab_size(engine)
    for token, _ in rules.logit_bias:
        if token >= vocab:
            raise ApiError(
                400, f"'logit_bias' names token id {token}; this model's ids are 0 to {vocab - 1}", param="logit_bias"
            )


def total(usage: Sequence[Usage]) -> Usage:
    """The token counts of all of a request's prompts."""
    return Usage(sum(u.prompt_tokens for u in usage), sum(u.completion_tokens for u in usage))


async def merged(streams: list[AsyncGenerator[Delta]], n: int) -> AsyncGenerator[Delta]:
    """The deltas of several prompts' generations as they come, choice j of prompt i renumbered i * n + j. The first
    error ends them all; closing the merge closes every generation (and its session)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(prompt: int, stream: AsyncGenerator[Delta]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    queue.put_nowait((prompt, delta))
        except Exception as e:  # noqa: BLE001 - handed to the merge's reader, which raises it
            queue.put_nowait((prompt, e))
        finally:
            queue.put_nowait((prompt, _DONE))

    tasks = [asyncio.create_task(pump(prompt, stream)) for prompt, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            prompt, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            elif isinstance(item, Delta):
                yield dataclasses.replace(item, index=prompt * n + item.index)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
