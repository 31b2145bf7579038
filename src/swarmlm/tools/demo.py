"""`swarmlm demo`: a local swarm splitting the bundled model answers a chat prompt (or chats), streaming tokens."""

from __future__ import annotations

import shlex
import signal
import sys
import threading
import time
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from swarmlm.client.generation import GenerationSession
from swarmlm.client.model import AutoDistributedModelForCausalLM, DistributedCausalLMMixin
from swarmlm.models.loading import load_config, load_tokenizer, resolve_model
from swarmlm.models.naming import model_name
from swarmlm.swarm.private import load_swarm_key
from swarmlm.tools.local_swarm import start_even_swarm

# the longest conversation the interactive chat keeps in one inference session
CHAT_MAX_TOKENS = 2048


def run_demo(
    prompt: str, num_servers: int = 2, max_new_tokens: int = 64, model: str = "smollm2-135m-instruct",
    chat: bool = False, api_port: int | None = None, revision: str | None = None, swarm_key_file: str | None = None,
) -> None:  # fmt: skip
    # convert once here, before servers start, rather than in every server; a Hub model's small files come now,
    # and each server fetches the shards of its own blocks
    model_dir = resolve_model(model, revision=revision)
    print(f"Starting {num_servers} local servers for {model} ...", flush=True)
    began = time.perf_counter()
    # the servers get the converted folder, which names the same swarm as `model` (models/naming.py)
    num_blocks = load_config(model_dir).num_hidden_layers
    with start_even_swarm(str(model_dir), num_blocks, num_servers, swarm_key_file) as swarm:
        print(f"Swarm ready in {time.perf_counter() - began:.1f} s: {' '.join(swarm.initial_peers)}", flush=True)
        if chat or api_port is not None:  # the swarm lives as long as the chat or the API: others may use it
            print(attach_lines(model, swarm.initial_peers, revision, swarm_key_file), flush=True)
        if api_port is not None:
            _serve_api(model, swarm.initial_peers, api_port, revision, swarm_key_file)
            print("Swarm stopped.")
            return
        with AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), initial_peers=swarm.initial_peers, swarm_key=swarm_key_file
        ) as distributed:
            tokenizer = load_tokenizer(model_dir)
            if chat:
                _interactive(distributed, tokenizer, max_new_tokens)
            else:
                _answer(distributed, tokenizer, prompt, max_new_tokens)
                print(ONE_SHOT_NOTE, flush=True)
    print("Swarm stopped.")


# after the one-shot answer: its swarm stops at once, so it is no swarm to attach to
ONE_SHOT_NOTE = "The swarm stops now; `swarmlm demo --chat` or `--api` keeps it running for others to attach to."


def attach_lines(
    model: str, initial_peers: list[str], revision: str | None = None, swarm_key_file: str | None = None
) -> str:
    """How another process of this machine joins the demo's swarm while it runs: the API, or a Python client."""
    shell = f"swarmlm api {shlex.quote(model)} --initial-peers {' '.join(map(shlex.quote, initial_peers))}"
    python = f"AutoDistributedModelForCausalLM.from_pretrained({model!r}, initial_peers={initial_peers!r}"
    if revision is not None:
        shell += f" --revision {shlex.quote(revision)}"
        python += f", revision={revision!r}"
    if swarm_key_file is not None:
        shell += f" --swarm-key {shlex.quote(swarm_key_file)}"
        python += f", swarm_key={swarm_key_file!r}"
    python += ")"
    return f"Attach to this swarm from another terminal while it runs:\n  {shell}\n  {python}"


def _serve_api(
    model: str, initial_peers: list[str], port: int, revision: str | None = None, swarm_key_file: str | None = None
) -> None:
    """The OpenAI-compatible API (and monitor) over the local swarm, in this process, until Ctrl-C."""
    from swarmlm.api.service import ApiOptions, run_api

    def show_how(base: str) -> None:  # once it listens: with --api-port 0, the port is known only then
        question = '"messages": [{"role": "user", "content": "What is the capital of France?"}]'
        body = f'{{"model": "{model_name(model).display}", {question}, "max_tokens": 64, "temperature": 0}}'
        curl = f"curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
        print(f"Monitor: {base}/   (Ctrl-C stops the API and the swarm)\nTry:\n  {curl}", flush=True)

    key = None if swarm_key_file is None else load_swarm_key(swarm_key_file)
    run_api(ApiOptions(model=model, initial_peers=tuple(initial_peers), port=port, revision=revision, swarm_key=key),
            on_ready=show_how)  # fmt: skip


class _AnswerPrinter(BaseStreamer):
    """generate()'s streamer: prints the answer as its tokens arrive and keeps them, so that an interrupted answer
    is known as far as it was shown."""

    def __init__(self, tokenizer: Any):  # tokenizers are typed Any: their methods return unions of their flags
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # the answer's tokens so far
        self.prompt_seen = False  # generate() hands over the prompt first
        self.shown = 0  # characters of the answer already printed
        self._printing = False  # between printing text and counting it as shown
        self._interrupted = False  # Ctrl-C came while printing: raised once the text is counted

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        self._show(final=False)

    def end(self) -> None:
        self._show(final=True)
        print(flush=True)

    def text(self) -> str:
        return str(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _show(self, final: bool) -> None:
        text = self.text()
        if not final and text.endswith("\ufffd"):  # the last token ends inside a character: wait for the rest
            return
        self._printing = True
        try:
            print(text[self.shown :], end="", flush=True)
            self.shown = len(text)
        finally:
            self._printing = False
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    def on_sigint(self, signum: int, frame: object) -> None:
        """Ctrl-C while generating: a KeyboardInterrupt, held back while text is being printed and counted (else
        the text printed before it would be printed again when the stopped answer is finished)."""
        if self._printing:
            self._interrupted = True
        else:
            raise KeyboardInterrupt


def _generate(
    model: DistributedCausalLMMixin, printer: _AnswerPrinter, input_ids: torch.Tensor, max_new_tokens: int,
    session: GenerationSession | None = None,
) -> None:  # fmt: skip
    """Greedy generation of an answer, printed as it comes (Ctrl-C stops it: KeyboardInterrupt propagates)."""
    began = time.perf_counter()
    model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=printer, session=session)
    elapsed = time.perf_counter() - began
    tokens = len(printer.ids)
    print(f"[{tokens} tokens in {elapsed:.1f} s, {tokens / elapsed:.1f} tokens/s]", file=sys.stderr, flush=True)


def _answer(model: DistributedCausalLMMixin, tokenizer: Any, prompt: str, max_new_tokens: int) -> None:
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    print(f"\nUser: {prompt}\nAssistant: ", end="", flush=True)
    _generate(model, _AnswerPrinter(tokenizer), ids["input_ids"], max_new_tokens)


def _interactive(model: DistributedCausalLMMixin, tokenizer: Any, max_new_tokens: int) -> None:
    """A chat in one inference session: each turn sends only the tokens the servers do not hold yet.

    The conversation is kept as messages and rendered by the chat template at every turn, so an answer cut at the
    token limit or by Ctrl-C still ends its turn as the template ends it (its end-of-turn token): the model never
    sees an assistant turn that runs into the next user turn. Ctrl-C during an answer stops it and the chat goes on;
    at the prompt, Ctrl-C or Ctrl-D ends the chat (an empty line, easily sent by accident, asks again)."""
    print("\nChat with the swarm (Ctrl-C stops an answer; Ctrl-D or Ctrl-C at the prompt ends the chat).")
    conversation: list[dict[str, str]] = []
    session = model.inference_session(max_length=CHAT_MAX_TOKENS)
    try:
        while (text := _read_turn()) is not None:
            conversation.append({"role": "user", "content": text})
            rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)
            ids = torch.tensor([rendered["input_ids"]])
            if ids.shape[1] + max_new_tokens > CHAT_MAX_TOKENS:
                print(f"The conversation reached {CHAT_MAX_TOKENS} tokens; start a new chat to go on.")
                break
            _keep_common_prefix(session, ids)
            print("Assistant: ", end="", flush=True)
            printer = _AnswerPrinter(tokenizer)
            main = threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
            default_sigint = signal.signal(signal.SIGINT, printer.on_sigint) if main else None
            try:
                _generate(model, printer, ids, max_new_tokens, session)
            except KeyboardInterrupt:
                printer.end()
                print("[answer stopped]", file=sys.stderr, flush=True)
                # the step under way was cut at any point (maybe with a reply still in flight): a new session
                # rebuilds the servers' caches from the conversation at the next turn
                session.close()
                session = model.inference_session(max_length=CHAT_MAX_TOKENS)
            finally:
                if main:
                    # None: the handler before was not set from Python; SIG_DFL (0) is restored as it was
                    before = signal.default_int_handler if default_sigint is None else default_sigint
                    signal.signal(signal.SIGINT, before)
            conversation.append({"role": "assistant", "content": printer.text()})
    finally:
        session.close()


def _read_turn() -> str | None:
    """The user's next message; None ends the chat (Ctrl-D or Ctrl-C). Empty lines are skipped: an Enter pressed
    twice must not end the chat and stop the swarm."""
    prompt = "\nYou: "
    while True:
        try:
            text = input(prompt).strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return None
        if text:
            return text
        prompt = "You: "  # the empty line already moved to a new line


def _keep_common_prefix(session: GenerationSession, ids: torch.Tensor) -> None:
    """Roll the session back to the longest prefix of `ids` (1, tokens) it has processed: generate() then sends
    only the rest (the template's rendering of the last answer may differ from the tokens generated: its
    end-of-turn, or its text tokenized anew)."""
    seen = session.token_ids
    if seen is None or session.position == 0:
        return
    width = min(seen.shape[1], ids.shape[1])
    differs = (seen[0, :width] != ids[0, :width]).nonzero()
    common = int(differs[0, 0]) if len(differs) else width
    session.position = session.prefix_tokens + common  # also cuts the session's record of its last output
