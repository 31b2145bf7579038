"""`swarmlm demo`: a local swarm splitting the bundled model, answering one chat prompt with streamed tokens."""

from __future__ import annotations

import sys
import time

import torch
from transformers import TextStreamer

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.local_swarm import start_even_swarm
from swarmlm.models.loading import load_config, load_tokenizer, resolve_model


def run_demo(
    prompt: str, num_servers: int = 2, max_new_tokens: int = 64, model: str = "smollm2-135m-instruct"
) -> None:
    model_dir = resolve_model(model)  # convert once here, before servers start, rather than in every server
    print(f"Starting {num_servers} local servers for {model} ...", flush=True)
    began = time.perf_counter()
    with start_even_swarm(str(model_dir), load_config(model_dir).num_hidden_layers, num_servers) as swarm:
        print(f"Swarm ready in {time.perf_counter() - began:.1f} s", flush=True)
        with AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), initial_peers=swarm.initial_peers
        ) as distributed:
            _chat(distributed, load_tokenizer(model_dir), prompt, max_new_tokens)
    print("Swarm stopped.")


def _chat(model: torch.nn.Module, tokenizer: object, prompt: str, max_new_tokens: int) -> None:
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    print(f"\nUser: {prompt}\nAssistant: ", end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    began = time.perf_counter()
    output = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, use_cache=False, streamer=streamer
    )
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    elapsed = time.perf_counter() - began
    print(f"\n[{new_tokens} tokens in {elapsed:.1f} s, {new_tokens / elapsed:.1f} tokens/s]", file=sys.stderr)
