"""The API's pure pieces: text deltas with stop strings, sampling, log-probabilities, request validation, and the
monitor's coverage."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import decoders

from swarmlm.api.engine import ChoiceText, SamplingParams, TokenLogprob, next_tokens, token_logprobs
from swarmlm.api.logprobs import TokenNames, chat_content, completion_lists
from swarmlm.api.monitor import describe_model, format_status, ranges
from swarmlm.api.sampling import LogitRules
from swarmlm.api.schemas import ApiError, ChatRequest, CompletionRequest, parse_body
from swarmlm.swarm.records import ServerRecord, ServerState

EOS = 0


class PieceTokenizer:
    """Token i decodes to PIECES[i]; EOS is special."""

    PIECES = ["</s>", "Hel", "lo", " wor", "ld", "!", "\xe2"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == EOS))


def run(tokens: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str | None]:
    choice = ChoiceText(PieceTokenizer(), stop, frozenset([EOS]))
    deltas = []
    for token in tokens:
        deltas.append(choice.add(token))
        if choice.finish_reason:
            return deltas, choice.finish_reason
    deltas.append(choice.finish("length"))
    return deltas, choice.finish_reason


def test_deltas_add_up_to_the_text_and_eos_stops() -> None:
    deltas, reason = run([1, 2, 3, 4, EOS, 5])
    assert "".join(deltas) == "Hello world" and reason == "stop"
    assert deltas[:2] == ["Hel", "lo"]  # without stop strings nothing is held back


def test_stop_strings_cut_the_text_and_are_never_sent() -> None:
    deltas, reason = run([1, 2, 3, 4, 5], stop=("o wo",))
    assert "".join(deltas) == "Hell" and reason == "stop"
    deltas, reason = run([1, 2, 3, 4], stop=("xyz",))
    assert "".join(deltas) == "Hello world" and reason == "length"
    assert all(len(d) <= 4 for d in deltas[:-1])  # held back up to the stop's length - 1


def test_a_half_decoded_character_waits() -> None:
    choice = ChoiceText(PieceTokenizer(), (), frozenset([EOS]))
    PieceTokenizer.PIECES.append("\ufffd")
    try:
        assert choice.add(len(PieceTokenizer.PIECES) - 1) == ""
    finally:
        PieceTokenizer.PIECES.pop()


def test_greedy_and_nucleus_sampling() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    generator = torch.Generator().manual_seed(0)
    assert next_tokens(logits, SamplingParams(4, temperature=0), generator).tolist() == [1]
    tight = SamplingParams(4, temperature=1.0, top_p=0.5)
    assert {next_tokens(logits, tight, generator).item() for _ in range(50)} == {1}
    loose = SamplingParams(4, temperature=1.0, top_p=1.0)
    assert {next_tokens(logits, loose, generator).item() for _ in range(200)} >= {1, 2}
    first = [next_tokens(logits, loose, torch.Generator().manual_seed(3)).item() for _ in range(5)]
    assert first == [next_tokens(logits, loose, torch.Generator().manual_seed(3)).item() for _ in range(5)]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ""}, "stop"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ],
)
def test_bad_parameters_are_named(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_body(json.dumps(body).encode(), ChatRequest)
    assert error.value.status == 400 and error.value.param == param


def test_requests_parse() -> None:
    message = {"role": "developer", "content": [{"type": "text", "text": "a"}]}
    body = {"model": "m", "messages": [message], "max_completion_tokens": 5, "max_tokens": 9, "stop": "x"}
    chat = parse_body(json.dumps(body).encode(), ChatRequest)
    assert chat.new_tokens() == 5 and chat.stop_strings() == ("x",)
    assert chat.messages[0].as_template_input() == {"role": "system", "content": "a"}
    completion = parse_body(b'{"model": "m", "prompt": ["hi"]}', CompletionRequest)
    assert completion.prompts() == ["hi"] and completion.max_tokens == 16 and not completion.echo


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]])],
)
def test_completion_prompts_are_texts_or_token_ids(prompt: object, prompts: list) -> None:
    body = {"model": "m", "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}
    assert parse_body(json.dumps(body).encode(), CompletionRequest).prompts() == prompts


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({"prompt": [[1], "a"]}, "prompt", "one kind of item"),
        ({"prompt": [1.5]}, "prompt", "a string, a list of strings"),
        ({"prompt": [True]}, "prompt", "list of token ids"),
        ({"prompt": [[]]}, "prompt", "list of lists of token ids"),
        ({"prompt": []}, "prompt", "not empty"),
        ({"prompt": {"a": 1}}, "prompt", "a string"),
        ({"prompt": ["x"] * 33}, "prompt", "at most 32"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "only with 'echo'"),
        ({"prompt": "x", "stop": ["a"] * 65}, "stop", "at most 64 stop strings"),
    ],
)
def test_bad_prompts_are_named_with_what_is_accepted(body: dict, param: str, says: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_body(json.dumps({"model": "m", **body}).encode(), CompletionRequest)
    assert error.value.status == 400 and error.value.param == param
    assert says in error.value.message, error.value.message


def test_many_stop_strings_and_sampling_settings_parse() -> None:
    stops = [f"stop{i}" for i in range(64)]  # lm-eval sends a task's stop sequences, more than OpenAI's 4
    body = {"model": "m", "prompt": "x", "stop": stops, "presence_penalty": 0.5, "frequency_penalty": -1,
            "logit_bias": {"7": -100, "3": 2.5}, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3}  # fmt: skip
    request = parse_body(json.dumps(body).encode(), CompletionRequest)
    assert request.stop_strings() == tuple(stops)
    assert request.rules() == LogitRules(0.5, -1.0, 1.3, ((7, -100.0), (3, 2.5)), 40, 0.05)
    nulls = {"model": "m", "prompt": "x", "presence_penalty": None, "top_k": None, "min_p": None,
             "repetition_penalty": None, "logit_bias": None, "frequency_penalty": None}  # fmt: skip
    assert parse_body(json.dumps(nulls).encode(), CompletionRequest).rules() == LogitRules()
    off = parse_body(b'{"model": "m", "prompt": "x", "top_k": -1}', CompletionRequest)  # vLLM's way to say "off"
    assert off.rules().top_k == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.5), ("frequency_penalty", -3), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}),
     ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0), ("top_k", 2.0)],
)  # fmt: skip
def test_sampling_settings_out_of_range_are_named(field: str, value: object) -> None:
    with pytest.raises(ApiError) as error:
        parse_body(json.dumps({"model": "m", "prompt": "x", field: value}).encode(), CompletionRequest)
    assert error.value.status == 400 and error.value.param == field


def test_a_message_name_is_accepted_and_media_parts_are_refused_as_text_only() -> None:
    message = {"role": "user", "content": "hi", "name": "bob"}
    chat = parse_body(json.dumps({"model": "m", "messages": [message]}).encode(), ChatRequest)
    assert chat.messages[0].as_template_input() == {"role": "user", "content": "hi", "name": "bob"}
    for part in ({"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):  # fmt: skip
        content = [{"type": "text", "text": "what is this?"}, part]
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        with pytest.raises(ApiError) as error:
            parse_body(json.dumps(body).encode(), ChatRequest)
        assert error.value.param == "messages.0.content" and "this model takes text only" in error.value.message


def record(start: int, end: int, state: ServerState = ServerState.ONLINE) -> ServerRecord:
    return ServerRecord(state=state, start=start, end=end, throughput=100.0, dtype="float32", version="0.1.0")


def test_coverage_counts_only_online_servers_that_answer() -> None:
    records = {"peerA": record(0, 3), "peerB": record(2, 5), "peerC": record(3, 5), "peerD": record(5, 6)}
    reachable = {"peerA": True, "peerB": True, "peerC": False, "peerD": True}
    model = describe_model("m", "m-prefix", 6, records, reachable, {"peerA": 0.0})
    assert [block["servers"] for block in model["blocks"]] == [1, 1, 2, 1, 1, 1] and model["complete"]
    assert {s["short_id"][-5:]: s["state"] for s in model["servers"]}["peerC"] == "unreachable"
    reachable["peerA"] = False
    model = describe_model("m", "m-prefix", 6, records, reachable, {})
    assert model["missing_blocks"] == [0, 1] and not model["complete"]
    text = format_status({"models": [model], "client": None})
    assert "MISSING blocks 0-1" in text and "coverage [..====]" in text


def test_ranges() -> None:
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and ranges([]) == ""


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"top_a": 5}, "top_a"),  # no field of OpenAI's nor of vLLM's
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages.0.audio"),
    ],
)
def test_fields_the_server_does_not_implement_are_refused_by_name(body: dict, param: str) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(ApiError) as error:
        parse_body(json.dumps(request).encode(), ChatRequest)
    assert error.value.status == 400 and error.value.param == param and param.split(".")[-1] in error.value.message


def test_fields_at_values_that_ask_for_nothing_are_accepted() -> None:
    reply = {"role": "assistant", "content": "a", "refusal": None, "tool_calls": None, "audio": None}  # as received
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, reply], "frequency_penalty": 0,
            "presence_penalty": 0.0, "logit_bias": {}, "tools": [], "response_format": {"type": "text"},
            "user": "someone", "store": False, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    assert parse_body(json.dumps(body).encode(), ChatRequest).logprob_count() == 2
    completion = {"model": "m", "prompt": "x", "best_of": 1, "suffix": None, "logprobs": 0}
    assert parse_body(json.dumps(completion).encode(), CompletionRequest).logprob_count() == 0
    for field, value in (("logprobs", 6), ("suffix", "end"), ("best_of", 2)):
        with pytest.raises(ApiError) as error:
            parse_body(json.dumps({**completion, field: value}).encode(), CompletionRequest)
        assert error.value.param == field
    assert "only null or 1); ask for 'n' choices with 'logprobs'" in error.value.message  # what to send instead


def test_sampling_fields_sent_as_null_take_their_defaults() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": None, "top_p": None,
            "n": None, "stream": None, "max_tokens": None, "seed": None, "stop": None}  # fmt: skip
    chat = parse_body(json.dumps(body).encode(), ChatRequest)
    assert (chat.temperature, chat.top_p, chat.n, chat.stream) == (1.0, 1.0, 1, False)
    completion = {"model": "m", "prompt": "x", "temperature": None, "top_p": None, "n": None}
    request = parse_body(json.dumps(completion).encode(), CompletionRequest)
    assert (request.temperature, request.top_p, request.n) == (1.0, 1.0, 1)
    with pytest.raises(ApiError) as error:
        parse_body(json.dumps({**completion, "temperature": 3}).encode(), CompletionRequest)
    assert error.value.param == "temperature"


def test_token_logprobs_are_the_models_log_softmax_with_sorted_alternatives() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0], [1.0, 1.5, 2.0, 0.0]])
    chosen = torch.tensor([2, 3])
    assert token_logprobs(logits, chosen, None) is None
    rows = token_logprobs(logits, chosen, 3)
    assert rows is not None
    expected = torch.log_softmax(logits, -1)
    for row, (logprob, top) in enumerate(rows):
        assert logprob == pytest.approx(expected[row, chosen[row]].item())
        assert [token for token, _ in top] == expected[row].argsort(descending=True)[:3].tolist()
        assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)
    assert [top for _, top in token_logprobs(logits, chosen, 0) or []] == [(), ()]


class PiecesTokenizer:
    """convert_ids_to_tokens of a byte-level BPE tokenizer, or of a SentencePiece one."""

    def __init__(self, byte_level: bool = True):
        decoder = decoders.ByteLevel() if byte_level else decoders.Metaspace()
        self.backend_tokenizer = type("Backend", (), {"decoder": decoder})()
        self.pieces = ["Ġw", "Ã©", "æ", "Ċ", "<|im_end|>"] if byte_level else ["▁the", "<0xE2>", "é"]

    def convert_ids_to_tokens(self, token: int) -> str:
        return self.pieces[token]


def test_token_names_give_raw_bytes_and_text() -> None:
    names = TokenNames(PiecesTokenizer())
    assert [names.bytes_of(t) for t in range(4)] == [b" w", "é".encode(), b"\xe6", b"\n"]
    assert names.text_of(1) == "é" and names.text_of(2) == "\ufffd" and names.text_of(4) == "<|im_end|>"
    sentencepiece = TokenNames(PiecesTokenizer(byte_level=False))
    assert [sentencepiece.bytes_of(t) for t in range(3)] == [b" the", b"\xe2", "é".encode()]
    entry = TokenLogprob(0, -0.5, ((0, -0.5), (1, -1.5)), 7)
    chat = chat_content([entry], names)["content"][0]
    assert chat == {
        "token": " w",
        "logprob": -0.5,
        "bytes": [32, 119],
        "top_logprobs": [
            {"token": " w", "logprob": -0.5, "bytes": [32, 119]},
            {"token": "é", "logprob": -1.5, "bytes": [195, 169]},
        ],
    }
    assert completion_lists([TokenLogprob(3, -2.0, ((0, -0.5),), 4)], names) == {
        "tokens": ["\n"],
        "token_logprobs": [-2.0],
        "top_logprobs": [{" w": -0.5, "\n": -2.0}],
        "text_offset": [4],
    }


def test_choice_text_knows_where_each_token_begins() -> None:
    choice = ChoiceText(PieceTokenizer(), (), frozenset([EOS]))
    offsets = []
    for token in [1, 2, 3, 4]:
        offsets.append(choice.decoded)
        choice.add(token)
    assert offsets == [0, 3, 5, 9]
