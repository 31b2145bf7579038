"""The demo chat's answer printer under Ctrl-C: an interrupt that lands while a piece of the answer is being printed
stops the answer right after it, and finishing the stopped answer prints nothing twice."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from swarmlm.tools.demo import _AnswerPrinter


class _Tokenizer:
    """Token i is the word WORDS[i] followed by a space."""

    WORDS = ["The", "sea", "is", "vast"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"{self.WORDS[i]} " for i in ids)


class _InterruptedScreen(io.StringIO):
    """A terminal where Ctrl-C is pressed while the n-th piece of text is being written."""

    def __init__(self, printer: _AnswerPrinter, at_write: int):
        super().__init__()
        self.printer, self.at_write, self.writes = printer, at_write, 0

    def write(self, text: str) -> int:
        written = super().write(text)
        self.writes += bool(text)  # print() also writes its (empty) end
        if text and self.writes == self.at_write:
            self.printer.on_sigint(2, None)
        return written


@pytest.mark.parametrize("at_write", [1, 2, 3])
def test_ctrl_c_while_printing_stops_after_the_piece_and_prints_nothing_twice(at_write: int, monkeypatch) -> None:
    printer = _AnswerPrinter(_Tokenizer())
    screen = _InterruptedScreen(printer, at_write)
    monkeypatch.setattr(sys, "stdout", screen)
    printer.put(torch.tensor([[9, 9]]))  # the prompt, not shown
    with pytest.raises(KeyboardInterrupt):
        for token in range(len(_Tokenizer.WORDS)):
            printer.put(torch.tensor([token]))
    printer.end()  # as the chat finishes a stopped answer
    assert screen.getvalue().rstrip("\n") == printer.text()
    assert printer.text() == "".join(f"{word} " for word in _Tokenizer.WORDS[:at_write])


def test_ctrl_c_between_pieces_stops_at_once(monkeypatch) -> None:
    printer = _AnswerPrinter(_Tokenizer())
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    printer.put(torch.tensor([[9]]))
    printer.put(torch.tensor([0]))
    with pytest.raises(KeyboardInterrupt):
        printer.on_sigint(2, None)
    printer.end()
    assert sys.stdout.getvalue().rstrip("\n") == "The "
