"""The API's pure pieces: text deltas with stop strings, sampling, request validation, and the monitor's coverage."""

from __future__ import annotations

import json

import pytest
import torch

from swarmlm.api.engine import ChoiceText, SamplingParams, next_tokens
from swarmlm.api.monitor import describe_model, format_status, ranges
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
    assert completion.text() == "hi" and completion.max_tokens == 16
    for bad in (b'{"model": "m", "prompt": "hi", "echo": true}', b'{"model": "m", "prompt": ["a", "b"]}'):
        with pytest.raises(ApiError):
            parse_body(bad, CompletionRequest)


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
