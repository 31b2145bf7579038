"""Benchmark: single-stream greedy decoding through 2- and 3-server loopback swarms against local generate().

Prints decode tokens/s, time to first token and the time to recover from a server SIGKILLed mid-generation, with
ratios against Hugging Face generate() with a KV cache in one local process (same weights, fp32), and the time a
decode step spends per hop outside the servers' compute (from the client's trace of every step).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from targets import line as target_line
from transformers import AutoModelForCausalLM

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.client.trace import RequestTrace
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
KILL_AT_TOKEN = 16  # the mid-generation failure happens after this many new tokens


class Clock:
    """A streamer recording when each new token arrives; optionally runs an action after a given token."""

    def __init__(self, at_token: int | None = None, action: object = None):
        self.times: list[float] = []
        self.at_token, self.action = at_token, action
        self.started = time.perf_counter()
        self.calls = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 1:  # the first call carries the prompt
            return
        self.times.append(time.perf_counter())
        if self.action is not None and len(self.times) == self.at_token:
            self.action()

    def end(self) -> None:
        pass

    def ttft_s(self) -> float:
        return self.times[0] - self.started

    def decode_tokens_per_s(self) -> float:
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


class HopMeter:
    """Per inference step of a swarm model, the step's time that its servers did not spend computing, per hop.

    The step's time is its request trace's (client/trace.py: from the session's step call to its output, so the
    client's embeddings, LM head and generate() loop are outside it); the hops are the messages of a step: 2 per
    server when the client relays it, 1 + the servers when it is pushed from server to server. The client keeps only
    its last trace, so the meter wraps where it keeps them. Steps with a retry or a replay are left out."""

    def __init__(self, model: AutoDistributedModelForCausalLM):
        client = model._client()
        keep = client.keep_trace
        self.hops_ms: list[float] = []

        def kept(finished: RequestTrace) -> None:
            keep(finished)
            calls = [call for call in finished.calls if call.kind.endswith("step")]
            if calls and not finished.retries and not finished.replays:
                pushed = any(call.kind == "pushed step" for call in calls)
                hops = len(calls) + 1 if pushed else 2 * len(calls)
                self.hops_ms.append((finished.total_ms - sum(call.compute_ms for call in calls)) / hops)

        client.keep_trace = kept  # generate() gives each session the client's keep_trace

    def median_ms(self) -> float:
        return statistics.median(self.hops_ms)


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, clock: Clock) -> torch.Tensor:
    clock.started = time.perf_counter()
    with torch.inference_mode():
        return model.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock
        )


def measure(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int) -> tuple[float, float, list]:
    """Median decode tokens/s and time to first token over `repeats` runs (after one warm-up), and the tokens."""
    timed_generate(model, ids, 4, Clock())
    rates, ttfts, output = [], [], None
    for _ in range(repeats):
        clock = Clock()
        output = timed_generate(model, ids, new_tokens, clock)
        rates.append(clock.decode_tokens_per_s())
        ttfts.append(clock.ttft_s())
    return statistics.median(rates), statistics.median(ttfts), output.tolist()


def recovery_time(model: torch.nn.Module, swarm: LocalSwarm, ids: torch.Tensor, new_tokens: int) -> float:
    """Extra delay of the token after a SIGKILL of the last span's server, over the median inter-token gap."""

    killing: list[threading.Thread] = []

    def kill_last_span() -> None:
        # in a thread of its own: LocalSwarm.kill sends SIGKILL at once, then waits until the server's p2p daemon and
        # DHT node are gone too (seconds), which is no part of the client's recovery
        session = model.active_session
        peer = session.route[-1].peer_id
        victim = next(s for s in swarm.servers if s.peer_id == peer)
        killing.append(threading.Thread(target=swarm.kill, args=(victim,), name="kill", daemon=True))
        killing[-1].start()

    clock = Clock(KILL_AT_TOKEN, kill_last_span)
    timed_generate(model, ids, new_tokens, clock)
    for thread in killing:
        thread.join()
    gaps = clock.gaps()
    return gaps[KILL_AT_TOKEN - 1] - statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    num_blocks = load_config(model_dir).num_hidden_layers
    tokenizer = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    print(f"model {args.model}, prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens, greedy, fp32, "
          f"torch threads {torch.get_num_threads()} (local and each server)")  # fmt: skip

    local = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    local_rate, local_ttft, expected = measure(local, ids, args.new_tokens, args.repeats)
    del local
    rows = [("local", local_rate, local_ttft, None, None)]
    for servers in (2, 3):
        spans = even_spans(num_blocks, servers)
        with LocalSwarm(str(model_dir)) as swarm:
            # a replica of the last span takes over when its server is killed
            swarm.start_servers([*spans, spans[-1]])
            with AutoDistributedModelForCausalLM.from_pretrained(
                str(model_dir), initial_peers=swarm.initial_peers
            ) as model:
                meter = HopMeter(model)
                rate, ttft, output = measure(model, ids, args.new_tokens, args.repeats)
                hop_ms = meter.median_ms()
                if output != expected:
                    raise SystemExit(f"{servers}-server swarm generated other tokens than the local model")
                recovery = recovery_time(model, swarm, ids, args.new_tokens)
        rows.append((f"{servers} servers", rate, ttft, recovery, hop_ms))

    print(f"\n{'run':<12}{'decode tok/s':>14}{'ratio':>8}{'TTFT ms':>10}{'ratio':>8}{'recovery ms':>13}"
          f"{'ms per hop':>12}")  # fmt: skip
    for name, rate, ttft, recovery, hop_ms in rows:
        recovery_text = "" if recovery is None else f"{recovery * 1000:.0f}"
        hop_text = "" if hop_ms is None else f"{hop_ms:.1f}"
        print(f"{name:<12}{rate:>14.1f}{rate / local_rate:>8.2f}{ttft * 1000:>10.0f}{ttft / local_ttft:>8.2f}"
              f"{recovery_text:>13}{hop_text:>12}")  # fmt: skip
    _, rate, ttft, _, hop_ms = rows[1]  # 2 servers
    print(target_line("decode", rate / local_rate))
    print(target_line("first_token", ttft / local_ttft))
    print(target_line("hop", hop_ms))


if __name__ == "__main__":
    main()
