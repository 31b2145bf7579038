"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` and the completions endpoint's four lists."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from swarmlm.api.engine import TokenLogprob

# a SentencePiece byte-fallback token: one raw byte
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# SentencePiece writes a space as this character
SENTENCEPIECE_SPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters and the bytes they stand for: printable Latin-1 bytes for themselves, the others
    (controls, space, 127-160, the soft hyphen) for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    return {chr(byte): byte for byte in printable} | {chr(0x100 + i): byte for i, byte in enumerate(others)}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


class TokenNames:
    """Each token's raw bytes and text as OpenAI reports them: bytes, since a token may hold part of a character,
    and text decoded from them (U+FFFD for such a part)."""

    def __init__(self, tokenizer: Any):  # transformers' tokenizers return unions that depend on their flags
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.bytes_of = functools.lru_cache(maxsize=65536)(self._bytes_of)

    def _bytes_of(self, token: int) -> bytes:
        piece = str(self.tokenizer.convert_ids_to_tokens(token))
        if self.byte_level and all(char in BYTE_LEVEL_ALPHABET for char in piece):
            return bytes(BYTE_LEVEL_ALPHABET[char] for char in piece)
        if (byte := BYTE_TOKEN.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        return piece.replace(SENTENCEPIECE_SPACE, " ").encode()

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode(errors="replace")


def chat_content(entries: Sequence[TokenLogprob], names: TokenNames) -> dict[str, Any]:
    """A chat choice's `logprobs`: one entry per token, with its most likely alternatives."""

    def described(token: int, logprob: float | None) -> dict[str, Any]:
        return {"token": names.text_of(token), "logprob": logprob, "bytes": list(names.bytes_of(token))}

    content = [{**described(entry.token, entry.logprob), "top_logprobs": [described(*top) for top in entry.top]}
               for entry in entries]  # fmt: skip
    return {"content": content, "refusal": None}


def completion_lists(entries: Sequence[TokenLogprob], names: TokenNames) -> dict[str, Any]:
    """A completion choice's `logprobs`: tokens, their log-probabilities, per token the most likely alternatives
    (with the chosen token, as OpenAI does: up to logprobs + 1 of them) and where each token's text begins. An echoed
    prompt's first token has null for both, as OpenAI's had: nothing before it predicts it."""
    top_logprobs: list[dict[str, float] | None] = []
    for entry in entries:
        if entry.logprob is None:
            top_logprobs.append(None)
            continue
        alternatives = {names.text_of(token): logprob for token, logprob in entry.top}
        alternatives.setdefault(names.text_of(entry.token), entry.logprob)
        top_logprobs.append(alternatives)
    return {
        "tokens": [names.text_of(entry.token) for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": top_logprobs,
        "text_offset": [entry.text_offset for entry in entries],
    }
