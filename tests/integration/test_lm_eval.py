"""lm-evaluation-harness, as its users run it, against `swarmlm api` over a real swarm of the bundled SmolLM2: its
`local-completions` model with its default settings (token-id prompts, echo, logprobs) scores a log-likelihood task
as its `hf` model does on the same checkpoint, and `local-chat-completions` answers as `hf --apply_chat_template`.

The tasks are the project's own (tests/data/lm_eval: a YAML each, data as JSON lines beside them), read through
lm-eval's TaskManager(include_path=...), so nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import one_thread, running_swarm
from tests.integration.http_process import api_process

NAME = "smollm2-135m-instruct"
TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
# per-item log-likelihoods through the swarm must equal the local model's this closely (sums over a few tokens of
# fp32 log-probabilities that agree to ~1e-5 each)
LOGLIKELIHOOD_ATOL = 1e-3


@pytest.fixture(scope="module")
def swarm(smollm_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(smollm_dir, [(0, 15), (15, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def api_url(smollm_dir: Path, swarm: LocalSwarm) -> Iterator[str]:
    with api_process(smollm_dir, swarm.initial_peers, NAME) as url:
        yield url


def evaluate(model: str, model_args: dict[str, Any], task: str, **options: Any) -> list[dict[str, Any]]:
    """lm-eval's per-item records of `task` run by `model`, by document."""
    import lm_eval  # imported here: it takes seconds, and only this module needs it
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                      task_manager=TaskManager(include_path=str(TASKS)), **options)  # fmt: skip
    assert results is not None
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def local_model(smollm_dir: Path, batch_size: int) -> dict[str, Any]:
    return {"pretrained": str(smollm_dir), "dtype": "float32", "device": "cpu", "batch_size": batch_size}


def accuracy(samples: list[dict[str, Any]]) -> float:
    return sum(sample["acc"] for sample in samples) / len(samples)


def test_local_completions_loglikelihoods_equal_the_hf_models(smollm_dir: Path, api_url: str) -> None:
    with one_thread():  # batches of 16: positions padded on the right change no logit of the others
        local = evaluate("hf", local_model(smollm_dir, 16), "swarmlm_facts")
    # only what the harness cannot find itself: where the API is, the model's name there, and its tokenizer (the API
    # has no tokenizer endpoint: lm-eval's probe of it gets a 404 and falls back to this one)
    swarm = evaluate("local-completions", {"model": NAME, "base_url": f"{api_url}/v1/completions",
                                           "tokenizer": str(smollm_dir)}, "swarmlm_facts")  # fmt: skip
    assert [sample["doc_id"] for sample in swarm] == [sample["doc_id"] for sample in local]
    differences = []
    for ours, theirs in zip(swarm, local, strict=True):
        pairs = list(zip(ours["filtered_resps"], theirs["filtered_resps"], strict=True))  # (loglikelihood, greedy)
        differences += [abs(a[0] - b[0]) for a, b in pairs]
        assert [a[1] for a, b in pairs] == [b[1] for a, b in pairs], ours["doc"]  # the same answers are greedy
    print(f"\nlm-eval swarmlm_facts ({len(local)} items, {len(differences)} log-likelihoods): accuracy local (hf) "
          f"{accuracy(local):.4f}, swarm (local-completions) {accuracy(swarm):.4f}; max |difference| of "
          f"log-likelihoods {max(differences):.2e}")  # fmt: skip
    assert max(differences) < LOGLIKELIHOOD_ATOL
    assert accuracy(swarm) == accuracy(local)
    assert [sample["acc"] for sample in swarm] == [sample["acc"] for sample in local]


def test_local_chat_completions_answers_equal_the_hf_models_with_its_chat_template(
    smollm_dir: Path, api_url: str
) -> None:
    with one_thread():  # batches of 1: each prompt unpadded, as the swarm runs it
        local = evaluate("hf", local_model(smollm_dir, 1), "swarmlm_answers", apply_chat_template=True)
    swarm = evaluate("local-chat-completions", {"model": NAME, "base_url": f"{api_url}/v1/chat/completions"},
                     "swarmlm_answers", apply_chat_template=True)  # fmt: skip
    answers = [sample["filtered_resps"][0] for sample in swarm]
    print(f"\nlm-eval swarmlm_answers: {answers}")
    assert answers == [sample["filtered_resps"][0] for sample in local]
    assert all(answers) and len(set(answers)) == len(answers)  # real answers, each its own
