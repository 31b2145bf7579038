"""Many sessions generating at once: the servers run their decode steps batched, and each output is exact, sessions
generating for left-padded batches of prompts included."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path

import torch

from tests.conftest import connected_model, load_reference, running_swarm

SESSIONS = 8
NEW_TOKENS = 16
PADDED = 2  # the first users generate for a left-padded batch of two prompts each
BATCH_LINE = re.compile(r"inference batch sessions=(\d+) blocks=\S+ rows=(\d+)")


def left_padded(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts as one batch, the shorter padded on the left: (input ids, attention mask)."""
    width = max(first.shape[1], second.shape[1])
    ids, mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    for row, prompt in enumerate((first, second)):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    return ids, mask


def test_concurrent_greedy_sessions_are_batched_and_exact(tiny_model_dir: Path) -> None:
    reference = load_reference(tiny_model_dir)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (1, 3 + i), generator=generator) for i in range(SESSIONS)]  # lengths differ
    masks: list[torch.Tensor | None] = [None] * SESSIONS
    for index in range(PADDED):
        prompts[index], masks[index] = left_padded(prompts[index], torch.randint(1, 128, (1, 2), generator=generator))
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        expected = [
            reference.generate(ids, attention_mask=mask, **options) for ids, mask in zip(prompts, masks, strict=True)
        ]
    outputs: list[torch.Tensor | None] = [None] * SESSIONS
    errors: list[BaseException] = []
    with running_swarm(tiny_model_dir, [(0, 2), (2, 5)]) as swarm, contextlib.ExitStack() as stack:
        # one client per user (a client model runs one generation at a time)
        models = [stack.enter_context(connected_model(tiny_model_dir, swarm)) for _ in range(SESSIONS)]
        start = threading.Barrier(SESSIONS)

        def generate(index: int) -> None:
            try:
                start.wait(30)
                outputs[index] = models[index].generate(prompts[index], attention_mask=masks[index], **options)
            except BaseException as e:  # noqa: BLE001 - reported by the test's thread
                errors.append(e)

        threads = [threading.Thread(target=generate, args=(i,)) for i in range(SESSIONS)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        elapsed = time.perf_counter() - began
        logs = [server.log_path.read_text() for server in swarm.servers]
    assert not errors, errors
    for got, want in zip(outputs, expected, strict=True):
        assert got is not None and got.tolist() == want.tolist()
    for log in logs:  # both servers ran decode steps of several sessions as one forward
        batches = [(int(sessions), int(rows)) for sessions, rows in BATCH_LINE.findall(log)]
        sizes = [sessions for sessions, _ in batches]
        assert sizes and max(sizes) > 1, log[-2000:]
        # the padded batches' steps (two rows each, with their masks) ran in such forwards too
        assert any(sessions > 1 and rows > sessions for sessions, rows in batches), log[-2000:]
    print(f"{SESSIONS} sessions x {NEW_TOKENS} tokens in {elapsed:.2f} s; batch sizes {sizes}")
