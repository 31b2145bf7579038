"""Benchmark: what constrained decoding (api/grammar.py, llguidance) costs per token, against a decode step.

SmolLM2-135M in fp32 (one process, Hugging Face forward with a KV cache, torch's default threads) decodes greedily
under the grammar of a JSON schema (a record of 6 fields: strings, an integer, a bounded list, an enum, a nested
object), as the API does for response_format json_schema: each step the model's forward and LM head, then the mask
(the matcher's bitmask, unpacked, logits outside it set to -inf) and the matcher fed the chosen token. Printed, as
medians over --repeats generations: the set-up (llguidance's view of the tokenizer, built once per API server; the
schema's grammar and matcher, per request), the unconstrained step (forward + argmax) and the grammar's work per
token, in ms, and their ratio (the mask's share of a step). The output must parse and fit the schema (checked).

With --compare, the same schema's compile time and per-token mask time in xgrammar and outlines-core too, where
installed (they are not dependencies: `pip install xgrammar outlines-core`), on the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarmlm.api.grammar import Grammars, json_schema_grammar
from swarmlm.models.loading import DEFAULT_MODEL, resolve_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 32},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "maxLength": 8}},
                    "required": ["city", "zip"]},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
}  # fmt: skip
QUESTION = "Describe a fictional person as a JSON record."


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def generate(
    model: Any, prompt: torch.Tensor, grammars: Grammars | None, grammar: str, new_tokens: int, eos: int
) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, and per token the step's ms (forward + argmax) and the grammar's ms (mask + advance; empty
    without grammars)."""
    guide = None if grammars is None else grammars.guide(grammar, 1)
    tokens: list[int] = []
    step_ms, mask_ms = [], []
    cache, ids = None, prompt
    for _ in range(new_tokens):
        start = time.perf_counter()
        out = model(ids, cache=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()  # (1, vocab)
        step_ms.append(ms_since(start))
        start = time.perf_counter()
        if guide is not None:
            logits = guide.masked(logits)
        token = int(logits.argmax(-1))
        ended = guide is not None and token != eos and guide.ended(0, token)
        if guide is not None:
            mask_ms.append(ms_since(start))
        if token == eos:
            break
        tokens.append(token)
        if ended:
            break
        ids = torch.tensor([[token]])
    return tokens, step_ms, mask_ms


def compare_libraries(tokenizer: Any, text: str, eos: int) -> None:
    """Compile time and per-token mask time of the other libraries, on the tokens of `text` (a valid output)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    vocab = len(tokenizer)
    try:
        import xgrammar as xgr  # optional, for comparison only

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        compile_ms = ms_since(start)
        matcher, bitmask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), []
        for token in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            matcher.accept_token(token)
            times.append(ms_since(start))
        print(f"{'xgrammar':<16}{compile_ms:>12.2f}{statistics.median(times):>14.3f}{max(times):>10.3f}")
    except ImportError:
        print("xgrammar: not installed")
    try:
        import outlines_core  # optional, for comparison only
        from outlines_core.json_schema import build_regex_from_schema

        from swarmlm.api.logprobs import TokenNames

        names, pieces = TokenNames(tokenizer), {}
        for token in range(vocab):
            if token != eos:
                pieces.setdefault(names.bytes_of(token), []).append(token)
        vocabulary = outlines_core.Vocabulary(eos, pieces)
        start = time.perf_counter()
        index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), vocabulary)
        compile_ms = ms_since(start)
        guide, mask, times = outlines_core.Guide(index), torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32), []
        for token in ids:
            start = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            if token != eos:
                guide.advance(token)
            times.append(ms_since(start))
        print(f"{'outlines-core':<16}{compile_ms:>12.2f}{statistics.median(times):>14.3f}{max(times):>10.3f}")
    except ImportError:
        print("outlines-core: not installed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", action="store_true", help="also time xgrammar and outlines-core")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = tokenizer.eos_token_id
    grammars = Grammars(tokenizer, frozenset([eos]), model.config.vocab_size)
    start = time.perf_counter()
    grammars.tokenizer()
    tokenizer_ms = ms_since(start)
    compile_ms = []
    for _ in range(5):
        start = time.perf_counter()
        grammars.check(json_schema_grammar(SCHEMA))
        compile_ms.append(ms_since(start))
    conversation = [{"role": "user", "content": QUESTION}]
    prompt = torch.tensor(
        [tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)["input_ids"]]
    )
    grammar = json_schema_grammar(SCHEMA)
    steps, masks, plain_steps = [], [], []
    with torch.inference_mode():
        generate(model, prompt, None, grammar, 4, eos)  # warm-up
        for _ in range(args.repeats):
            tokens, step_ms, mask_ms = generate(model, prompt, grammars, grammar, args.new_tokens, eos)
            steps += step_ms
            masks += mask_ms
            plain_steps += generate(model, prompt, None, grammar, len(tokens), eos)[1]
    text = tokenizer.decode(tokens)
    record = json.loads(text)  # the grammar's output parses (a ValueError here is a failure)
    assert set(record) == set(SCHEMA["required"]), record
    print(
        f"model {args.model}, {model.config.vocab_size} tokens, torch threads {torch.get_num_threads()}; "
        f"output ({len(tokens)} tokens): {text}"
    )
    print(f"set-up: tokenizer for llguidance {tokenizer_ms:.0f} ms (once per server); schema grammar + matcher "
          f"{statistics.median(compile_ms):.2f} ms (per request)")  # fmt: skip
    step, plain, mask = statistics.median(steps), statistics.median(plain_steps), statistics.median(masks)
    print(f"\n{'per token, ms (median)':<40}{'value':>10}")
    print(f"{'decode step, unconstrained':<40}{plain:>10.2f}")
    print(f"{'decode step, under the grammar':<40}{step:>10.2f}")
    print(f"{'grammar: mask + advance':<40}{mask:>10.3f}")
    print(f"{'grammar: max over tokens':<40}{max(masks):>10.3f}")
    print(f"ratio (mask / unconstrained step): {mask / plain:.4f}; constrained step / unconstrained: "
          f"{(step + mask) / plain:.3f}")  # fmt: skip
    if args.compare:
        print(f"\n{'library':<16}{'compile ms':>12}{'mask ms/token':>14}{'max ms':>10}")
        compare_libraries(tokenizer, text, eos)


if __name__ == "__main__":
    main()
