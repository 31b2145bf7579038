"""The cache the API's sessions hold on the servers, shared between its users (api/cache_share.py), tried as a hostile
user would: one client address floods `swarmlm api` with long streaming requests sized to fill the API's share of a
server's cache (a server started with a small --cache-tokens), while another address asks short questions that must be
answered, exactly as local greedy decoding answers them, throughout."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import load_reference, one_thread, running_swarm
from tests.integration.http_process import api_process

NAME = "smollm2-135m-instruct"
# the server's cache: room for 2048 tokens (batch x length) of sessions, of which one peer (the API) may hold half
CACHE_TOKENS = 2048
API_SHARE_TOKENS = CACHE_TOKENS // 2
# a flood request holds its prompt and its 256 new tokens from the start (api/engine.py INITIAL_RESERVE): two of them
# leave the API's share 4 tokens, less than any question needs
FLOOD_NEW_TOKENS = 256
FLOOD_PROMPT_TOKENS = API_SHARE_TOKENS // 2 - FLOOD_NEW_TOKENS - 2
# two flooding requests hold the share, two more wait for room (each starts again when it ends or is refused)
FLOODERS = 4
QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "What do bees make?", "Name a primary color."]
HONEST_TOKENS = 8
HONEST_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def swarm(smollm_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(smollm_dir, [(0, 30)], extra_args=["--cache-tokens", str(CACHE_TOKENS)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def api_url(smollm_dir: Path, swarm: LocalSwarm) -> Iterator[str]:
    with api_process(smollm_dir, swarm.initial_peers, NAME) as url:
        yield url


def client_from(api_url: str, address: str, timeout_s: float) -> openai.OpenAI:
    """An SDK client whose connections come from `address` (any 127.x.y.z reaches a server on 127.0.0.1): a user."""
    transport = httpx2.HTTPTransport(local_address=address)  # the transport of the SDK's own httpx
    return openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s,
                         http_client=httpx2.Client(transport=transport, timeout=timeout_s))  # fmt: skip


class Flood:
    """FLOODERS threads, each streaming long completions from one address without pause until stopped."""

    def __init__(self, client: openai.OpenAI, prompt: list[int], eos: int):
        self.client, self.prompt, self.eos = client, prompt, eos
        self.stop = threading.Event()
        self.tokens = 0  # streamed chunks with text, over all requests (one per token)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._flood, daemon=True) for _ in range(FLOODERS)]

    def _flood(self) -> None:
        while not self.stop.is_set():
            try:
                stream = self.client.completions.create(
                    model=NAME, prompt=self.prompt, max_tokens=FLOOD_NEW_TOKENS, temperature=0, stream=True,
                    logit_bias={str(self.eos): -100},  # never ends early: it holds its room to the end
                )  # fmt: skip
                with stream:
                    for chunk in stream:
                        self.tokens += bool(chunk.choices and chunk.choices[0].text)
                        if self.stop.is_set():
                            break
            except openai.OpenAIError as e:
                self.errors.append(type(e).__name__)
                time.sleep(0.2)

    def __enter__(self) -> Flood:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def local_answers(smollm_dir: Path, tokenizer: Any) -> list[str]:
    """Local greedy answers of HONEST_TOKENS tokens to QUESTIONS."""
    reference = load_reference(smollm_dir)
    answers = []
    with one_thread(), torch.inference_mode():
        for question in QUESTIONS:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            out = reference.generate(ids, max_new_tokens=HONEST_TOKENS, do_sample=False)[0, ids.shape[1] :]
            answers.append(tokenizer.decode(out, skip_special_tokens=True))
    return answers


def test_a_flooding_user_cannot_lock_others_out_of_the_cache(smollm_dir: Path, api_url: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    expected = local_answers(smollm_dir, tokenizer)
    words = tokenizer(" the quick brown fox jumps over the lazy dog" * 40)["input_ids"]
    prompt = words[:FLOOD_PROMPT_TOKENS]
    honest = client_from(api_url, "127.0.0.1", HONEST_TIMEOUT_S)
    outcomes: list[tuple[bool, float, str]] = []  # (served exactly, seconds, what went wrong)
    with Flood(client_from(api_url, "127.0.0.2", 120.0), prompt, tokenizer.eos_token_id) as flood:
        deadline = time.monotonic() + 60
        while flood.tokens < 2 * FLOODERS and time.monotonic() < deadline:  # the flood's sessions are open
            time.sleep(0.1)
        assert flood.tokens >= 2 * FLOODERS, f"the flood did not start: {flood.errors}"
        flood_tokens_before = flood.tokens
        for question, answer in zip(QUESTIONS, expected, strict=True):
            began = time.monotonic()
            try:
                reply = honest.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                                       max_tokens=HONEST_TOKENS, temperature=0)  # fmt: skip
                text = reply.choices[0].message.content
                outcomes.append((text == answer, time.monotonic() - began, "" if text == answer else repr(text)))
            except openai.OpenAIError as e:
                outcomes.append((False, time.monotonic() - began, f"{type(e).__name__}: {e}"[:200]))
        flood_tokens_during = flood.tokens - flood_tokens_before
    served = sum(ok for ok, _, _ in outcomes)
    latencies = [seconds for _, seconds, _ in outcomes]
    print(f"honest user: {served}/{len(outcomes)} served exactly, latency median {statistics.median(latencies):.2f} s"
          f" max {max(latencies):.2f} s; the flood streamed {flood_tokens_during} tokens meanwhile"
          f" (its errors: {len(flood.errors)})")  # fmt: skip
    assert flood_tokens_during > 0  # the flood went on while the honest user was served
    assert served == len(outcomes), f"the honest user was not served: {[why for ok, _, why in outcomes if not ok]}"
