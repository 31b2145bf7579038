"""The OpenAI-compatible API (`swarmlm api`) over a real swarm of the bundled SmolLM2, driven by the official `openai`
client: answers equal local greedy generation, streams, stop strings, n, concurrency, disconnects and bad requests."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import torch
from transformers import AutoTokenizer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from swarmlm.api.engine import Engine, SamplingParams
from swarmlm.api.service import MONITOR_LINE, READY_LINE
from swarmlm.cli.main import API_KEY_ENV
from swarmlm.models.loading import load_tokenizer
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import connected_model, load_reference, one_thread, running_swarm
from tests.integration.http_process import api_process, http_process, http_server

NAME = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?", "What is 12 times 12?",
    "Who wrote Hamlet?", "What do bees make?", "How many legs has a spider?", "What is the boiling point of water?",
]  # fmt: skip
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def reference(smollm_dir: Path) -> torch.nn.Module:
    return load_reference(smollm_dir)


@pytest.fixture(scope="module")
def local_answer(reference: torch.nn.Module, tokenizer: Any) -> Any:
    """Local greedy generation of the same model: (text, finish reason, tokens) of a conversation or a raw prompt."""
    cache: dict[tuple[str, bool, int], tuple[str, str, int]] = {}

    def answer(text: str, chat: bool = True, new_tokens: int = NEW_TOKENS) -> tuple[str, str, int]:
        key = (text, chat, new_tokens)
        if key not in cache:
            if chat:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
                )
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).input_ids
            with torch.inference_mode():
                out = reference.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1] :]
            reason = "stop" if out[-1].item() == tokenizer.eos_token_id else "length"
            cache[key] = (tokenizer.decode(out, skip_special_tokens=True), reason, len(out))
        return cache[key]

    return answer


@pytest.fixture(scope="module")
def swarm(smollm_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(smollm_dir, [(0, 15), (15, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def api_url(smollm_dir: Path, swarm: LocalSwarm) -> Iterator[str]:
    with api_process(smollm_dir, swarm.initial_peers, NAME) as url:
        yield url


@pytest.fixture(scope="module")
def client(api_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_url}/v1", api_key="not-needed", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, question: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", NEW_TOKENS)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}], **kwargs)


def post(url: str, body: bytes, method: str = "POST") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [NAME]


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """The token ids of a one-question conversation, ready for the assistant's answer."""
    conversation = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_chat_completion_equals_local_greedy(client: openai.OpenAI, local_answer: Any, tokenizer: Any) -> None:
    reply = ask(client, QUESTIONS[0])
    text, reason, tokens = local_answer(QUESTIONS[0])
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == reason
    assert reply.choices[0].message.role == "assistant" and reply.object == "chat.completion"
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == tokens
    assert reply.usage.total_tokens == len(prompt) + tokens


def test_streaming_yields_the_same_text_then_done(client: openai.OpenAI, local_answer: Any) -> None:
    text, reason, tokens = local_answer(QUESTIONS[2])
    stream = ask(client, QUESTIONS[2], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token, not at once
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens


def test_completions_endpoint_equals_local_greedy(client: openai.OpenAI, local_answer: Any) -> None:
    prompt = "The three largest cities of Germany are"
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == local_answer(prompt, chat=False)[:2]
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == local_answer(prompt, chat=False)[0]


def test_stop_strings_cut_the_text_before_them(client: openai.OpenAI, local_answer: Any) -> None:
    full = local_answer(QUESTIONS[0])[0]
    assert "Paris" in full  # the stop string must occur in the unstopped answer for this test to mean anything
    reply = ask(client, QUESTIONS[0], stop=["Paris", "London"])
    assert reply.choices[0].message.content == full[: full.index("Paris")]
    assert reply.choices[0].finish_reason == "stop"
    stream = ask(client, QUESTIONS[0], stop="Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full[: full.index("Paris")]


def test_n_choices_and_seeded_sampling(client: openai.OpenAI, local_answer: Any) -> None:
    greedy = ask(client, QUESTIONS[1], n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert [c.message.content for c in greedy.choices] == [local_answer(QUESTIONS[1])[0]] * 2
    assert greedy.usage.completion_tokens == 2 * local_answer(QUESTIONS[1])[2]
    sampled = [ask(client, QUESTIONS[1], n=2, temperature=1.0, seed=7) for _ in range(2)]
    texts = [[c.message.content for c in reply.choices] for reply in sampled]
    assert texts[0] == texts[1]  # same seed, same texts
    streamed = ask(client, QUESTIONS[1], n=2, temperature=1.0, seed=7, stream=True)
    by_choice = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            by_choice[choice.index] += choice.delta.content or ""
    assert by_choice == texts[0]


def test_eight_concurrent_requests_are_all_correct(client: openai.OpenAI, local_answer: Any) -> None:
    expected = [local_answer(q)[0] for q in QUESTIONS]
    answers: list[str | None] = [None] * len(QUESTIONS)

    def work(index: int) -> None:
        answers[index] = ask(client, QUESTIONS[index]).choices[0].message.content

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(QUESTIONS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert answers == expected


def sessions_open(model: Any) -> int:
    return sum(info.sessions_open for info in model.server_infos().values())


def test_a_client_leaving_mid_stream_frees_the_servers_session(
    smollm_dir: Path, swarm: LocalSwarm, api_url: str
) -> None:
    # a plain socket: the client that goes away closes its connection, with no HTTP library in between
    body = {"model": NAME, "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 2000, "stream": True}
    data = json.dumps(body).encode()
    with connected_model(smollm_dir, swarm) as model:
        host, port = api_url.removeprefix("http://").split(":")
        connection = socket.create_connection((host, int(port)), timeout=60)
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
        received = b""
        while received.count(b'"content": "') < 4:  # the role chunk, then three tokens
            part = connection.recv(4096)
            assert part, received
            received += part
        assert sessions_open(model) == 2  # one session on each of the two servers
        connection.close()
        deadline = time.monotonic() + 15
        while sessions_open(model) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sessions_open(model) == 0
    with urllib.request.urlopen(f"{api_url}/api/v1/swarm", timeout=30) as response:
        recent = json.loads(response.read())["client"]["recent"]
    assert recent[0]["outcome"] == "cancelled" and recent[0]["tokens"] < 100


def open_stream(api_url: str, question: str) -> socket.socket:
    """A streaming chat request on a plain socket, long enough to still run when the test acts."""
    body = {"model": NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 2000, "stream": True}
    data = json.dumps(body).encode()
    host, port = api_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=60)
    connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    return connection


def received(connection: socket.socket, wait_s: float, until_tokens: int | None = None) -> bytes:
    """What arrives within wait_s, until the server closes the connection, or until `until_tokens` content chunks
    (the role's first one counted) have come."""
    data, deadline = b"", time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        connection.settimeout(left)
        try:
            part = connection.recv(4096)
        except TimeoutError:
            break
        if not part:
            break
        data += part
        if until_tokens is not None and data.count(b'"content": "') >= until_tokens:
            break
    return data


def test_requests_past_max_concurrent_wait_and_stopping_the_api_closes_running_sessions(
    smollm_dir: Path, swarm: LocalSwarm
) -> None:
    args = ["api", str(smollm_dir), "--served-model-name", NAME, "--port", "0", "--max-concurrent", "1"]
    with http_server([*args, "--initial-peers", *swarm.initial_peers], READY_LINE) as (url, process):
        with connected_model(smollm_dir, swarm) as model:
            first = open_stream(url, QUESTIONS[2])
            assert received(first, 60.0, until_tokens=3).count(b'"content": "') >= 3
            second = open_stream(url, QUESTIONS[4])
            assert received(second, 2.0) == b""  # its turn has not come: not even the reply's headers
            assert received(first, 60.0, until_tokens=2).count(b'"content": "') >= 2  # while the first goes on
            assert sessions_open(model) == 2  # the first request's, on each of the two servers
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
            # both end with the reason: the streaming one as an error event, the waiting one as a 503 reply
            assert b"the API server is shutting down" in received(first, 10.0)
            rest = received(second, 10.0)
            assert rest.startswith(b"HTTP/1.1 503") and b"the API server is shutting down" in rest
            deadline = time.monotonic() + 15
            while sessions_open(model) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert sessions_open(model) == 0
            first.close()
            second.close()


BAD_REQUESTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": NAME}).encode(), 400, "messages"),
    (json.dumps({"model": NAME, "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}).encode(), 400, None),
    (json.dumps({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}).encode(), 400,
     "temperature"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400,
     "max_tokens"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 65}).encode(),
     400, "stop"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}).encode(), 400,
     "messages"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi " * 9000}]}).encode(), 400, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
def test_each_malformed_request_gets_its_error_and_the_server_keeps_serving(
    api_url: str, client: openai.OpenAI, local_answer: Any, body: bytes, status: int, param: str | None
) -> None:
    code, reply = post(f"{api_url}/v1/chat/completions", body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    if "9000" in body.decode()[:200] or len(body) > 20000:
        assert error["code"] == "context_length_exceeded", error
    assert ask(client, QUESTIONS[0], max_tokens=3).choices[0].message.content == local_answer(QUESTIONS[0], True, 3)[0]


def test_wrong_paths_and_methods_get_openai_errors(api_url: str) -> None:
    code, reply = post(f"{api_url}/v1/nothing", b"{}")
    assert code == 404 and reply["error"]["type"] == "not_found_error"
    code, reply = post(f"{api_url}/v1/chat/completions", b"", method="PUT")
    assert code == 405 and reply["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="context length"):
        openai.OpenAI(base_url=f"{api_url}/v1", api_key="x", max_retries=0).completions.create(
            model=NAME, prompt="word " * 9000, max_tokens=5
        )


def test_a_swarm_missing_blocks_answers_503_naming_them(smollm_dir: Path, swarm: LocalSwarm) -> None:
    # the same DHT, a swarm name no server serves: every block is missing
    args = ["api", str(smollm_dir), "--served-model-name", NAME, "--port", "0", "--dht-prefix", "nobody-serves-this",
            "--missing-blocks-timeout", "1", "--initial-peers", *swarm.initial_peers]  # fmt: skip
    with http_process(args, READY_LINE) as url:
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for stream in (False, True):
            code, reply = post(f"{url}/v1/chat/completions", json.dumps({**body, "stream": stream}).encode())
            assert code == 503 and reply["error"]["code"] == "missing_blocks", reply
            assert "block(s) 0-29" in reply["error"]["message"]


def test_the_api_serves_the_monitor_with_its_own_route(api_url: str, client: openai.OpenAI) -> None:
    ask(client, QUESTIONS[0], max_tokens=2)
    with urllib.request.urlopen(f"{api_url}/api/v1/swarm", timeout=30) as response:
        snapshot = json.loads(response.read())
    (model,) = snapshot["models"]
    assert model["complete"] and model["num_blocks"] == 30 and len(model["servers"]) == 2
    assert {server["state"] for server in model["servers"]} == {"online"}
    route = snapshot["client"]["route"]
    assert [(hop["start"], hop["end"]) for hop in route] == [(0, 15), (15, 30)]
    with urllib.request.urlopen(f"{api_url}/", timeout=30) as response:
        assert b"monitor.js" in response.read()


def local_logprobs(reference: torch.nn.Module, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Local greedy tokens after `prompt` and the log-softmax of the logits that chose each, (tokens, vocab)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = reference.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        logits = reference(out).logits[0, len(prompt) - 1 : -1]
    return out[0, len(prompt) :].tolist(), torch.log_softmax(logits.float(), dim=-1)


def check_against(
    logprobs: list[float], tops: list[list[tuple[str, float]]], tokens: list[int], local: torch.Tensor, count: int
) -> None:
    """The swarm's greedy tokens' log-probabilities and alternatives equal the local model's to 1e-4."""
    assert len(logprobs) == len(tops) == len(tokens)
    for place, (logprob, top, token) in enumerate(zip(logprobs, tops, tokens, strict=True)):
        assert abs(logprob - local[place, token].item()) < 1e-4
        values = [value for _, value in top]
        assert len(top) == count and values == sorted(values, reverse=True)
        expected = local[place].topk(count).values.tolist()
        assert max((abs(a - b) for a, b in zip(values, expected, strict=True)), default=0.0) < 1e-4
        if count:
            assert values[0] == pytest.approx(logprob, abs=1e-6)  # greedy: the chosen token is the likeliest


def test_chat_logprobs_equal_the_local_models_streamed_or_not(
    client: openai.OpenAI, reference: torch.nn.Module, tokenizer: Any
) -> None:
    question = QUESTIONS[0]
    prompt = chat_ids(tokenizer, question)
    tokens, local = local_logprobs(reference, list(prompt), NEW_TOKENS)
    assert tokens[-1] == tokenizer.eos_token_id  # the answer ends within NEW_TOKENS: its end has an entry too
    reply = ask(client, question, logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert b"".join(bytes(entry.bytes) for entry in content[:-1]).decode() == reply.choices[0].message.content
    assert content[-1].token == tokenizer.eos_token
    assert [entry.token for entry in content] == [bytes(entry.bytes).decode() for entry in content]
    tops = [[(top.token, top.logprob) for top in entry.top_logprobs] for entry in content]
    check_against([entry.logprob for entry in content], tops, tokens, local, 5)
    streamed = [chunk for chunk in ask(client, question, logprobs=True, top_logprobs=2, stream=True)]
    entries = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]  # fmt: skip
    tops = [[(top.token, top.logprob) for top in entry.top_logprobs] for entry in entries]
    check_against([entry.logprob for entry in entries], tops, tokens, local, 2)
    assert ask(client, question).choices[0].logprobs is None  # not asked for


def test_completion_logprobs_equal_the_local_models_streamed_or_not(
    client: openai.OpenAI, reference: torch.nn.Module, tokenizer: Any
) -> None:
    prompt = "The three largest cities of Germany are"
    tokens, local = local_logprobs(reference, tokenizer(prompt).input_ids, NEW_TOKENS)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=3)
    lists, text = reply.choices[0].logprobs, reply.choices[0].text
    assert "".join(lists.tokens) == text
    assert lists.text_offset == [len("".join(lists.tokens[:place])) for place in range(len(lists.tokens))]
    tops = [sorted(top.items(), key=lambda item: -item[1]) for top in lists.top_logprobs]
    assert [top[0][0] for top in tops] == lists.tokens  # greedy: each chosen token is the likeliest of its place
    check_against(lists.token_logprobs, tops, tokens, local, 3)
    streamed = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=1, stream=True
    )
    parts = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices[0].logprobs]
    assert [offset for part in parts for offset in part.text_offset] == lists.text_offset
    tops = [list(top.items()) for part in parts for top in part.top_logprobs]
    check_against([value for part in parts for value in part.token_logprobs], tops, tokens, local, 1)


UNSUPPORTED = [
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "Paris"}}, "prediction"),  # json_object: test_api_tools
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs=True
    ("chat", {"extra_body": {"top_a": 5}}, "top_a"),  # no field of OpenAI's nor of vLLM's
    ("chat", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),  # vLLM's, out of its range
    ("completions", {"suffix": "world"}, "suffix"),
    ("completions", {"logprobs": 6}, "logprobs"),  # OpenAI's limit is 5
]


@pytest.mark.parametrize(("endpoint", "options", "param"), UNSUPPORTED)
def test_a_field_the_server_does_not_implement_gets_a_400_naming_it(
    client: openai.OpenAI, endpoint: str, options: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        if endpoint == "chat":
            ask(client, QUESTIONS[0], max_tokens=2, **options)
        else:
            client.completions.create(model=NAME, prompt="Hello", max_tokens=2, **options)
    assert error.value.param == param and param in error.value.message


def test_malformed_bodies_are_400_never_500(api_url: str) -> None:
    """Bodies a stranger can send for free: each is the caller's error, said as such."""
    url, base = f"{api_url}/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    deep = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    cases = {
        "nesting 100,000 deep": deep,
        "seed 2^70": json.dumps({**base, "seed": 2**70}).encode(),
        "max_tokens as a string": json.dumps({**base, "max_tokens": "8"}).encode(),
        "n as a string": json.dumps({**base, "n": "2"}).encode(),
        "stream as 1": json.dumps({**base, "stream": 1}).encode(),
    }
    for name, body in cases.items():
        code, reply = post(url, body)
        assert code == 400, (name, code, reply)
        assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"], name


def test_half_sent_requests_are_cut_off_and_hold_no_descriptor(smollm_dir: Path, swarm: LocalSwarm) -> None:
    """Connections that send a request's headers (or body) a byte at a time, or never finish, are closed after
    --http-timeout; the API's descriptors come back, and a whole request is answered meanwhile."""
    args = ["api", str(smollm_dir), "--served-model-name", NAME, "--port", "0", "--http-timeout", "2",
            "--initial-peers", *swarm.initial_peers]  # fmt: skip
    with http_server(args, READY_LINE, stopped_by_test=False) as (url, popen):
        host, port = url.removeprefix("http://").split(":")
        process = psutil.Process(popen.pid)
        before = process.num_fds()
        sockets = []
        for i in range(200):
            sock = socket.create_connection((host, int(port)))
            if i % 2:  # headers that never end
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            else:  # headers whole, then a body that never comes
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            sockets.append(sock)
        try:
            # the API accepts them as its loop gets to it (later on a loaded machine): wait until it holds them
            deadline = time.monotonic() + 15
            while process.num_fds() < before + 150 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert process.num_fds() >= before + 150
            code, reply = post(f"{url}/v1/models", b"", method="GET")
            assert code == 200
            deadline = time.monotonic() + 20
            while process.num_fds() > before + 10 and time.monotonic() < deadline:
                time.sleep(0.5)
            held = process.num_fds() - before
            closed = sum(1 for sock in sockets if _closed(sock))
        finally:
            for sock in sockets:
                sock.close()
        print(f"\n200 half-sent requests: {closed} closed by the API, {held} descriptors still held")
        assert held <= 10 and closed >= 190


def _closed(sock: socket.socket) -> bool:
    """Whether the API answered (408) or closed the connection."""
    sock.settimeout(1.0)
    try:
        sock.recv(65536)
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


def test_a_generation_outgrowing_its_first_reservation_equals_local(
    smollm_dir: Path, swarm: LocalSwarm, reference: torch.nn.Module
) -> None:
    """A request holds room on the servers for its prompt and a few new tokens, and grows its session (the history
    replayed into a larger one) as the answer grows: every token equals local greedy decoding, for one choice and
    for two."""
    tokenizer = load_tokenizer(smollm_dir)
    ids = chat_ids(tokenizer, "Tell me a long story about a dragon.")
    with torch.inference_mode():
        local = reference.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids) :].tolist()
    expected = tokenizer.decode(local, skip_special_tokens=True)
    with connected_model(smollm_dir, swarm) as model:
        engine = Engine(model, tokenizer, 8192, max_concurrent=2, initial_reserve=4)  # grows at 4, 8, 16, 32 tokens

        async def answer(n: int) -> list[str]:
            texts, usage = [""] * n, []
            async for delta in engine.stream(ids, SamplingParams(40, temperature=0.0, n=n), usage):
                texts[delta.index] += delta.text
            return texts

        try:
            assert asyncio.run(answer(1)) == [expected]
            assert asyncio.run(answer(2)) == [expected, expected]
        finally:
            engine.close()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Status, content type and body of a GET."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_an_api_key_guards_the_api_while_health_metrics_and_monitor_stay_open(
    smollm_dir: Path, swarm: LocalSwarm, local_answer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-test-1234")  # the environment's key: it shows in no process list
    args = [
        "api",
        str(smollm_dir),
        "--served-model-name",
        NAME,
        "--port",
        "0",
        "--initial-peers",
        *swarm.initial_peers,
    ]
    output: list[str] = []
    with http_process(args, READY_LINE, output) as url:
        deadline = time.monotonic() + 10
        while not any(line.startswith(MONITOR_LINE) for line in output):
            assert time.monotonic() < deadline, output
            time.sleep(0.1)
        assert f"{MONITOR_LINE}{url}/\n" in output
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        code, reply = post(f"{url}/v1/chat/completions", json.dumps(body).encode())  # no Authorization header
        assert code == 401 and set(reply["error"]) == {"message", "type", "param", "code"}, reply  # OpenAI's shape
        stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as error:
            ask(stranger, QUESTIONS[0])
        assert error.value.status_code == 401
        assert isinstance(error.value.body, dict) and error.value.body["code"] == "invalid_api_key"
        assert error.value.body["type"] == "invalid_request_error"
        member = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test-1234", max_retries=0, timeout=120)
        reply = ask(member, QUESTIONS[0])
        assert reply.choices[0].message.content == local_answer(QUESTIONS[0])[0]
        assert get(f"{url}/health")[::2] == (200, '{"status": "ok"}')
        assert get(f"{url}/api/v1/swarm")[0] == 200 and get(f"{url}/")[0] == 200
        code, content_type, metrics = get(f"{url}/metrics")
    assert code == 200 and content_type.startswith("text/plain; version=0.0.4"), content_type
    print("\n" + metrics)
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert samples['swarmlm_requests_total{outcome="ok"}'] == "1"
    assert samples['swarmlm_errors_total{kind="invalid_api_key"}'] == "2"
    assert samples["swarmlm_generation_tokens_total"] == str(reply.usage.completion_tokens)
    assert samples["swarmlm_prompt_tokens_total"] == str(reply.usage.prompt_tokens)
    assert samples['swarmlm_time_to_first_token_seconds_bucket{le="+Inf"}'] == "1"
    assert samples["swarmlm_request_duration_seconds_count"] == "1"
    assert samples["swarmlm_requests_running"] == "0"
    assert "# TYPE swarmlm_time_per_output_token_seconds histogram" in metrics


# the servers' line for each inference step they run (server/inference.py, logged with --log-requests)
STEP_LINE = re.compile(r"inference step blocks=(\d+):(\d+) tokens=(\d+) past=(\d+)")


def step_lines(swarm: LocalSwarm) -> list[list[tuple[int, ...]]]:
    """Per server, the inference steps in its log so far: (start, end, tokens, past)."""
    return [
        [tuple(map(int, m)) for m in STEP_LINE.findall(s.log_path.read_text(errors="replace"))] for s in swarm.servers
    ]


def new_steps(swarm: LocalSwarm, before: list[list[tuple[int, ...]]], count: int) -> list[list[tuple[int, ...]]]:
    """The steps each server logged since `before`, once each has `count` of them (logs arrive a little late)."""
    deadline = time.monotonic() + 10
    while True:
        steps = [now[len(old) :] for now, old in zip(step_lines(swarm), before, strict=True)]
        if all(len(server) >= count for server in steps) or time.monotonic() > deadline:
            return steps
        time.sleep(0.1)


def prompt_logprobs(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The local model's log-softmax over the prompt: row i predicts token i + 1, (tokens - 1, vocab)."""
    with torch.inference_mode():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def test_echo_gives_the_prompts_log_probabilities_from_one_forward_through_the_swarm(
    client: openai.OpenAI, swarm: LocalSwarm, reference: torch.nn.Module, tokenizer: Any, local_answer: Any
) -> None:
    text = "The three largest cities of Germany are"
    ids = tokenizer(text).input_ids
    local = prompt_logprobs(reference, ids)
    before = step_lines(swarm)
    scored = client.completions.create(model=NAME, prompt=ids, echo=True, logprobs=2, max_tokens=0, temperature=0)
    assert new_steps(swarm, before, 1) == [[(0, 15, len(ids), 0)], [(15, 30, len(ids), 0)]]  # one forward, no more
    choice, lists = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == text and choice.finish_reason == "length" and "".join(lists.tokens) == text
    assert lists.token_logprobs[0] is None and lists.top_logprobs[0] is None  # nothing predicts the first token
    assert lists.text_offset == [len("".join(lists.tokens[:place])) for place in range(len(ids))]
    for place in range(1, len(ids)):
        assert abs(lists.token_logprobs[place] - local[place - 1, ids[place]].item()) < 1e-4
        top = sorted(lists.top_logprobs[place].values(), reverse=True)
        expected = local[place - 1].topk(2).values.tolist()
        assert len(top) in (2, 3) and max(abs(a - b) for a, b in zip(top, expected, strict=False)) < 1e-4
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    answer, _, tokens = local_answer(text, chat=False)
    generated = client.completions.create(
        model=NAME, prompt=text, echo=True, logprobs=2, max_tokens=NEW_TOKENS, temperature=0
    )
    lists = generated.choices[0].logprobs
    assert generated.choices[0].text == text + answer and len(lists.tokens) == len(ids) + tokens
    assert lists.token_logprobs[: len(ids)] == pytest.approx(scored.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lists.text_offset == [len("".join(lists.tokens[:place])) for place in range(len(lists.tokens))]
    streamed = client.completions.create(
        model=NAME, prompt=text, echo=True, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == text + answer


def test_lists_of_prompts_and_token_ids_get_their_choices_numbered_as_openai_does(
    client: openai.OpenAI, local_answer: Any, tokenizer: Any
) -> None:
    texts = ["The three largest cities of Germany are", "Paris is the capital of"]
    expected = [local_answer(text, chat=False, new_tokens=6)[0] for text in texts]
    ids = [tokenizer(text).input_ids for text in texts]
    for prompt in (texts, ids):
        reply = client.completions.create(model=NAME, prompt=prompt, n=2, max_tokens=6, temperature=0)
        assert [choice.index for choice in reply.choices] == [0, 1, 2, 3]  # prompt i, choice j: i * n + j
        assert [choice.text for choice in reply.choices] == [expected[0]] * 2 + [expected[1]] * 2
        assert reply.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    by_choice = ["", "", "", ""]
    for chunk in client.completions.create(model=NAME, prompt=ids, n=2, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            by_choice[choice.index] += choice.text
    assert by_choice == [expected[0]] * 2 + [expected[1]] * 2
    one = client.completions.create(model=NAME, prompt=ids[1], max_tokens=6, temperature=0)  # a list of ints
    assert one.choices[0].text == expected[1]
    with pytest.raises(openai.BadRequestError, match="token id 999999"):
        client.completions.create(model=NAME, prompt=[1, 999999], max_tokens=1)


def local_penalized(reference: torch.nn.Module, ids: list[int], new_tokens: int, eos: int, **rules: Any) -> list[int]:
    """Greedy decoding of the local model with the rules applied by hand, in vLLM's order: logit_bias, the
    repetition penalty (Hugging Face's processor, over prompt and output), then OpenAI's frequency and presence
    penalties over the output."""
    repetition = RepetitionPenaltyLogitsProcessor(rules.get("repetition_penalty", 1.0))
    frequency, presence = rules.get("frequency_penalty", 0.0), rules.get("presence_penalty", 0.0)
    out: list[int] = []
    step, cache = torch.tensor([ids]), None
    for _ in range(new_tokens):
        with torch.no_grad():
            result = reference(step, cache=cache, use_cache=True)
        cache, logits = result.past_key_values, result.logits[0, -1].float()
        for token, bias in rules.get("logit_bias", {}).items():
            logits[int(token)] += bias
        logits = repetition(torch.tensor([ids + out]), logits[None])[0]
        for token in set(out):
            logits[token] -= out.count(token) * frequency + presence
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
        step = torch.tensor([[out[-1]]])
    return out


def test_penalties_and_logit_bias_at_temperature_0_equal_local_greedy_decoding_with_the_same_rules(
    client: openai.OpenAI, reference: torch.nn.Module, tokenizer: Any, local_answer: Any
) -> None:
    text, new_tokens = "red, blue, red, blue, red, blue,", 8
    ids, eos = tokenizer(text).input_ids, tokenizer.eos_token_id
    with one_thread():
        plain = tokenizer.decode(local_penalized(reference, ids, new_tokens, eos), skip_special_tokens=True)
    blue, green = tokenizer(" blue").input_ids[0], tokenizer(" green").input_ids[0]
    cases = [
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"repetition_penalty": 1.3, "top_k": 5, "min_p": 0.05},  # top_k and min_p leave the likeliest token be
        {"logit_bias": {str(blue): -100, str(green): 2.5}, "presence_penalty": -0.5},
    ]
    for rules in cases:
        with one_thread():
            tokens = local_penalized(reference, ids, new_tokens, eos, **rules)
        expected = tokenizer.decode(tokens, skip_special_tokens=True)
        assert expected != plain, rules  # the rules change the answer: the comparison below means something
        vllm = ("top_k", "min_p", "repetition_penalty")  # not the SDK's arguments: sent as extra_body
        official = {k: v for k, v in rules.items() if k not in vllm}
        extra = {k: v for k, v in rules.items() if k in vllm}
        reply = client.completions.create(
            model=NAME, prompt=text, max_tokens=new_tokens, temperature=0, extra_body=extra, **official
        )
        assert reply.choices[0].text == expected, rules


def test_an_answer_that_ends_at_once_keeps_its_logprobs_entry(
    client: openai.OpenAI, reference: torch.nn.Module, tokenizer: Any
) -> None:
    question = QUESTIONS[0]
    prompt = chat_ids(tokenizer, question)
    with torch.inference_mode():
        local = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    eos = tokenizer.eos_token_id
    reply = ask(client, question, logprobs=True, top_logprobs=3, logit_bias={str(eos): 100})  # ends at once
    choice = reply.choices[0]
    assert choice.message.content == "" and choice.finish_reason == "stop"
    (entry,) = choice.logprobs.content
    assert entry.token == tokenizer.eos_token and abs(entry.logprob - local[eos].item()) < 1e-4  # the model's own
    expected = local.topk(3)
    assert [top.token for top in entry.top_logprobs] == [tokenizer.decode([t]) for t in expected.indices.tolist()]
    assert [top.logprob for top in entry.top_logprobs] == pytest.approx(expected.values.tolist(), abs=1e-4)


def test_a_message_name_is_accepted_and_image_parts_get_a_text_only_400(
    client: openai.OpenAI, local_answer: Any
) -> None:
    message = {"role": "user", "content": QUESTIONS[0], "name": "ada"}
    named = client.chat.completions.create(model=NAME, max_tokens=NEW_TOKENS, temperature=0, messages=[message])
    assert named.choices[0].message.content == local_answer(QUESTIONS[0])[0]  # this template has no use for names
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, [{"type": "text", "text": "What is this?"}, image])  # type: ignore[arg-type]
    assert error.value.param == "messages.0.content" and "this model takes text only" in error.value.message
