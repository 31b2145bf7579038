"""`swarmlm demo`: a local swarm splitting the bundled model answers a chat prompt (or chats), streaming tokens."""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any

import torch
from transformers import TextStreamer

from swarmlm.client.model import AutoDistributedModelForCausalLM, DistributedCausalLMMixin
from swarmlm.local_swarm import start_even_swarm
from swarmlm.models.loading import load_config, load_tokenizer, resolve_model
from swarmlm.models.naming import model_name

# the longest conversation the interactive chat keeps in one inference session
CHAT_MAX_TOKENS = 2048


def run_demo(
    prompt: str, num_servers: int = 2, max_new_tokens: int = 64, model: str = "smollm2-135m-instruct",
    chat: bool = False, api_port: int | None = None,
) -> None:  # fmt: skip
    model_dir = resolve_model(model)  # convert once here, before servers start, rather than in every server
    print(f"Starting {num_servers} local servers for {model} ...", flush=True)
    began = time.perf_counter()
    # the servers get the converted folder, which names the same swarm as `model` (models/naming.py)
    with start_even_swarm(str(model_dir), load_config(model_dir).num_hidden_layers, num_servers) as swarm:
        print(f"Swarm ready in {time.perf_counter() - began:.1f} s: {' '.join(swarm.initial_peers)}", flush=True)
        print(attach_lines(model, swarm.initial_peers), flush=True)
        if api_port is not None:
            _serve_api(model, swarm.initial_peers, api_port)
            print("Swarm stopped.")
            return
        with AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), initial_peers=swarm.initial_peers
        ) as distributed:
            tokenizer = load_tokenizer(model_dir)
            if chat:
                _interactive(distributed, tokenizer, max_new_tokens)
            else:
                _answer(distributed, tokenizer, prompt, max_new_tokens)
    print("Swarm stopped.")


def attach_lines(model: str, initial_peers: list[str]) -> str:
    """How another process of this machine joins the demo's swarm while it runs: the API, or a Python client."""
    shell = f"swarmlm api {shlex.quote(model)} --initial-peers {' '.join(map(shlex.quote, initial_peers))}"
    python = f"AutoDistributedModelForCausalLM.from_pretrained({model!r}, initial_peers={initial_peers!r})"
    return f"Attach to this swarm from another terminal while it runs:\n  {shell}\n  {python}"


def _serve_api(model: str, initial_peers: list[str], port: int) -> None:
    """The OpenAI-compatible API (and monitor) over the local swarm, in this process, until Ctrl-C."""
    from swarmlm.api.service import ApiOptions, run_api

    base = f"http://127.0.0.1:{port}"
    question = '"messages": [{"role": "user", "content": "What is the capital of France?"}]'
    body = f'{{"model": "{model_name(model).display}", {question}, "max_tokens": 64, "temperature": 0}}'
    curl = f"curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
    print(f"Monitor: {base}/   (Ctrl-C stops the API and the swarm)\nTry:\n  {curl}", flush=True)
    run_api(ApiOptions(model=model, initial_peers=tuple(initial_peers), port=port))


# tokenizers are typed Any: the methods of transformers' tokenizers return unions that depend on their flags
def _generate(
    model: DistributedCausalLMMixin, tokenizer: Any, input_ids: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    began = time.perf_counter()
    output = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
    new_tokens = output.shape[1] - input_ids.shape[1]
    elapsed = time.perf_counter() - began
    print(f"[{new_tokens} tokens in {elapsed:.1f} s, {new_tokens / elapsed:.1f} tokens/s]", file=sys.stderr)
    return output


def _answer(model: DistributedCausalLMMixin, tokenizer: Any, prompt: str, max_new_tokens: int) -> None:
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    print(f"\nUser: {prompt}\nAssistant: ", end="", flush=True)
    _generate(model, tokenizer, ids["input_ids"], max_new_tokens)


def _interactive(model: DistributedCausalLMMixin, tokenizer: Any, max_new_tokens: int) -> None:
    """A chat in one inference session: each turn sends only its own tokens; the servers keep the rest."""
    print("\nChat with the swarm (an empty line or Ctrl-D ends it).")
    conversation: list[dict[str, str]] = []
    ids: torch.Tensor | None = None
    with model.inference_session(max_length=CHAT_MAX_TOKENS):
        while True:
            try:
                text = input("\nYou: ").strip()
            except EOFError:
                break
            if not text:
                break
            rendered = tokenizer.apply_chat_template(conversation, tokenize=False) if conversation else ""
            conversation.append({"role": "user", "content": text})
            full = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            new = tokenizer(full[len(rendered) :], return_tensors="pt", add_special_tokens=False).input_ids
            ids = new if ids is None else torch.cat([ids, new], dim=1)
            if ids.shape[1] + max_new_tokens > CHAT_MAX_TOKENS:
                print(f"The conversation reached {CHAT_MAX_TOKENS} tokens; start a new chat to go on.")
                break
            print("Assistant: ", end="", flush=True)
            output = _generate(model, tokenizer, ids, max_new_tokens)
            answer = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
            conversation.append({"role": "assistant", "content": answer})
            ids = output
