"""`swarmlm demo --chat` as a person uses it, in a pseudo-terminal: answers cut at --max-new-tokens close their turn,
Ctrl-C stops an answer and the chat goes on, Ctrl-D ends it with the swarm shut down."""

from __future__ import annotations

import codecs
import fcntl
import os
import re
import select
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.utils.processes import set_parent_death_signal
from tests.conftest import load_reference

NEW_TOKENS = 24
# the demo starts two servers (each loads SmolLM2 and joins the DHT) and a client: generous on a busy machine
START_TIMEOUT_S = 300.0
ANSWER_TIMEOUT_S = 120.0
# a log line the demo may print between two pieces of an answer
LOG_LINE = re.compile(r"\d\d:\d\d:\d\d [A-Z]+ [\w.]+: [^\n]*\n")
ENDED = re.compile(r"\n\[(\d+ tokens in [^\n]*|answer stopped)\]\n")


def _attach_terminal() -> None:
    """In the child: die with the test, and take the pseudo-terminal as its controlling terminal (as a shell's
    child would), so that Ctrl-C typed into it reaches the demo's process group."""
    set_parent_death_signal()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """The demo on the slave side of a pseudo-terminal; the test types on the master side and reads the screen."""

    def __init__(self, args: list[str]):
        self.master, slave = os.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "swarmlm.cli.main", *args], stdin=slave, stdout=slave, stderr=slave,
            start_new_session=True, preexec_fn=_attach_terminal,  # the child only execs after it
        )  # fmt: skip
        os.close(slave)
        self.printed = ""  # everything printed so far, as the terminal sends it (\r\n line ends)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.read = 0  # characters of the screen already consumed by wait_for
        self.closed = False  # the demo's side of the terminal is closed

    def wait_for(self, marker: str, timeout_s: float) -> str:
        """What the demo printed from the last marker up to this one (the terminal's \\r\\n read as \\n)."""
        deadline = time.monotonic() + timeout_s
        while (found := self.screen.find(marker, self.read)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                raise AssertionError(f"no {marker!r} within {timeout_s} s; the screen ends:\n{self.screen[-3000:]}")
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: the demo exited and its side of the terminal is closed
                    chunk = b""
                self.closed = not chunk
                self.printed += self.decoder.decode(chunk)
        text, self.read = self.screen[self.read : found], found + len(marker)
        return text

    @property
    def screen(self) -> str:
        return self.printed.replace("\r\n", "\n")

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self.master)


@pytest.fixture(scope="module")
def terminal() -> Iterator[Terminal]:
    shell = Terminal(["demo", "--chat", "--max-new-tokens", str(NEW_TOKENS)])
    try:
        yield shell
    finally:
        shell.close()


def answer_of(printed: str) -> tuple[str, bool]:
    """The answer's text from what followed "Assistant: ", and whether Ctrl-C stopped it."""
    printed = LOG_LINE.sub("", printed.replace("^C", ""))  # the terminal echoes Ctrl-C as ^C
    ended = ENDED.search(printed)
    assert ended is not None, printed
    return printed[: ended.start()], ended.group(1) == "answer stopped"


def repeats_a_sentence(text: str) -> bool:
    sentences = [s.strip() for s in re.split(r"[.!?\n]", text) if s.strip()]
    return len(sentences) != len(set(sentences))


class Chat:
    """The conversation typed into the demo, and the local model's greedy answers to it."""

    def __init__(self, terminal: Terminal, model_dir: Path):
        self.terminal, self.conversation = terminal, list[dict[str, str]]()
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self.reference = load_reference(model_dir)

    def local_answer(self, question: str) -> str:
        """What the model answers `question` after the conversation so far (greedy, at most NEW_TOKENS)."""
        messages = [*self.conversation, {"role": "user", "content": question}]
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.inference_mode():
            out = self.reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :]
        return str(self.tokenizer.decode(out, skip_special_tokens=True))

    def ask(self, question: str, interrupt: bool = False) -> tuple[str, bool]:
        """Type a question at the prompt; the answer as printed (Ctrl-C typed once a word of it shows, with
        interrupt), and whether it was stopped. Returns at the next prompt."""
        self.terminal.type(question + "\n")
        self.terminal.wait_for("Assistant: ", ANSWER_TIMEOUT_S)
        printed = ""
        if interrupt:
            printed = self.terminal.wait_for(" ", ANSWER_TIMEOUT_S) + " "
            self.terminal.type("\x03")
        answer, stopped = answer_of(printed + self.terminal.wait_for("\nYou: ", ANSWER_TIMEOUT_S))
        self.conversation += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return answer, stopped


def test_a_chat_goes_on_after_cut_and_stopped_answers_then_ends_cleanly(smollm_dir: Path, terminal: Terminal) -> None:
    chat = Chat(terminal, smollm_dir)
    terminal.wait_for("You: ", START_TIMEOUT_S)
    # an empty line (Enter pressed twice) asks again: it neither ends the chat nor stops the swarm
    terminal.type("\n")
    terminal.wait_for("You: ", ANSWER_TIMEOUT_S)
    assert terminal.process.poll() is None
    # an answer cut at the token limit, then one that follows a closed turn (an open one changes this answer)
    first, stopped = chat.ask("Tell me about the moon.")
    assert not stopped and len(chat.tokenizer(first).input_ids) >= NEW_TOKENS - 2  # cut at the limit, not ended
    expected = chat.local_answer("Who wrote Hamlet?")
    second, stopped = chat.ask("Who wrote Hamlet?")
    assert (second, stopped) == (expected, False)
    assert "Shakespeare" in second and not repeats_a_sentence(second)
    # Ctrl-C mid-answer stops it; the prompt comes back and the next answer follows the stopped one
    expected = chat.local_answer("Write a long poem about the sea.")
    poem, stopped = chat.ask("Write a long poem about the sea.", interrupt=True)
    assert stopped, "the answer ended before Ctrl-C reached it"
    assert expected.startswith(poem) and len(poem) < len(expected)
    expected = chat.local_answer("What is the capital of France?")
    assert chat.ask("What is the capital of France?") == (expected, False)
    assert "Paris" in expected
    # Ctrl-D at the prompt: the chat ends, the swarm stops, nothing is left running
    helpers = psutil.Process(terminal.process.pid).children(recursive=True)
    assert len(helpers) >= 2  # the two servers at least
    terminal.type("\x04")
    terminal.wait_for("Swarm stopped.", ANSWER_TIMEOUT_S)
    assert terminal.process.wait(60) == 0
    _, alive = psutil.wait_procs(helpers, timeout=30)
    assert not alive, [process.pid for process in alive]
