"""Constrained decoding: grammars for response_format and forced tool calls, one matcher per choice, and the token
mask applied to the LM head's logits on the client before sampling, so the output is valid by construction.

The grammar library is llguidance (chosen against xgrammar and outlines-core; figures in docs/api.md and
bench/grammar.py): on SmolLM2's 49152-token vocabulary a JSON schema compiles in under 1 ms (outlines-core: 140 ms,
xgrammar: 8 ms) and a mask costs about 0.02 ms per token; it refuses the JSON Schema keywords it does not implement
by name, bounds a grammar's work and memory with parser limits, takes Lark grammars with embedded JSON schemas (the
tool-call formats) and is a self-contained wheel (xgrammar pulls in triton).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import llguidance.hf
import torch

# longest grammar source accepted (a JSON schema or the tools' schemas, serialized): far above any real schema, and
# it bounds what the parser limits below have to chew on
MAX_GRAMMAR_BYTES = 128 << 10
# the grammar's lexer states at most; each holds 1-2 kB, so this bounds a matcher's memory at about 40 MB
MAX_LEXER_STATES = 20_000
# the lexer's work to build a grammar (~50k units per ms: about 20 ms) and per token (~14k per ms: about 7 ms)
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 100_000
# JSON output written compactly: the model is not offered whitespace between tokens (fewer tokens per object, and
# a small model cannot wander off into endless blank lines inside a forced object)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar this server cannot enforce: an unsupported schema feature, or one past the limits."""


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        max_lexer_states=MAX_LEXER_STATES, initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL,
        verbose_errors=False,
    )  # fmt: skip


def _bounded(source: str) -> str:
    if len(source.encode()) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the schema is larger than {MAX_GRAMMAR_BYTES >> 10} KiB")
    return source


# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas
SUBSCHEMA = frozenset(["items", "additionalProperties", "not", "contains", "if", "then", "else"])
SUBSCHEMA_LISTS = frozenset(["anyOf", "oneOf", "allOf", "prefixItems"])
SUBSCHEMA_MAPS = frozenset(["properties", "patternProperties", "$defs", "definitions"])


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others (additionalProperties false where it
    says nothing): its outputs are a subset of the schema's, so still valid, and a small model cannot wander off
    adding properties until max_tokens (OpenAI's strict mode demands the same of the schemas it takes)."""
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key, value in schema.items():
        if key in SUBSCHEMA:
            result[key] = closed(value)
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            result[key] = [closed(item) for item in value]
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            result[key] = {name: closed(item) for name, item in value.items()}
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "patternProperties"} & set(schema):
        result["additionalProperties"] = False
    return result


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text valid under `schema` (its objects closed)."""
    source = _bounded(json.dumps(closed(schema)))
    return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)  # type: ignore[arg-type]


def json_object_grammar() -> str:
    """The grammar of any JSON object (response_format json_object)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (which may embed JSON schemas as `%json {...}`)."""
    return llguidance.LLMatcher.grammar_from_lark(_bounded(lark))


def embedded_json(schema: dict[str, Any]) -> str:
    """A JSON schema inside a Lark grammar (`%json {...}`), written as compactly as json_schema_grammar's."""
    return "%json " + json.dumps({**closed(schema), "x-guidance": JSON_OPTIONS}, separators=(",", ":"))


class Grammars:
    """One engine's grammar machinery: llguidance's view of the tokenizer (built once, on first use: about 0.3 s
    for a 49k vocabulary), grammar checks and the matchers of a request's choices."""

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], vocab_size: int):
        self.hf_tokenizer, self.eos_ids, self.vocab_size = tokenizer, eos_ids, vocab_size
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # handlers check grammars in worker threads: build it once
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids)
                )
            return self._tokenizer

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher, checked: its grammar's errors (unsupported features, limits) raise GrammarError."""
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the lexer now, so a grammar past the limits fails here, not later
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def check(self, grammar: str) -> None:
        """Raise GrammarError if `grammar` cannot be enforced (blocking: call it from a worker thread)."""
        self.matcher(grammar)

    def guide(self, grammar: str, rows: int) -> Guide:
        return Guide([self.matcher(grammar) for _ in range(rows)], self.vocab_size)


class Guide:
    """The matchers of a request's choices (one per row), each fed the tokens its choice generates."""

    def __init__(self, matchers: list[llguidance.LLMatcher], vocab_size: int):
        self.matchers, self.vocab_size = matchers, vocab_size
        words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)  # (rows, words): bit t = token t
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """(rows, vocab) bool: the tokens each choice's grammar allows next."""
        for row, matcher in enumerate(self.matchers):
            view = self._bitmask[row]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
            if matcher.is_error():
                raise GrammarError(f"the grammar failed while generating: {matcher.get_error()}")
        bits = (self._bitmask.unsqueeze(-1) >> self._bits) & 1  # (rows, words, 32)
        return bits.view(len(self.matchers), -1)[:, : self.vocab_size].bool()

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) logits with every token the grammars forbid at -inf."""
        allowed = self.allowed()
        return logits.masked_fill(~allowed[:, : logits.shape[-1]].to(logits.device), float("-inf"))

    def ended(self, row: int, token: int) -> bool:
        """Feed `token` to the row's matcher; True when its grammar allows nothing more (the choice is complete)."""
        matcher = self.matchers[row]
        if not matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {matcher.get_error()}")
        return bool(matcher.is_stopped())


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar a chat request's response_format asks for (None: free text)."""
    kind = getattr(response_format, "type", "text")
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        schema = response_format.json_schema.json_schema
        return json_schema_grammar({} if schema is None else schema)
    return None


def masked(guide: Guide | None, logits: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) logits as the rows' grammars allow them (unchanged without a guide)."""
    return logits if guide is None else guide.masked(logits)
