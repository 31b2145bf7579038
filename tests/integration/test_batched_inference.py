"""Many sessions generating at once: the servers run their decode steps batched, and each output is exact."""

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
BATCH_LINE = re.compile(r"inference batch sessions=(\d+) blocks=")


def test_concurrent_greedy_sessions_are_batched_and_exact(tiny_model_dir: Path) -> None:
    reference = load_reference(tiny_model_dir)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (1, 3 + i), generator=generator) for i in range(SESSIONS)]  # lengths differ
    with torch.inference_mode():
        expected = [reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for ids in prompts]
    outputs: list[torch.Tensor | None] = [None] * SESSIONS
    errors: list[BaseException] = []
    with running_swarm(tiny_model_dir, [(0, 2), (2, 5)]) as swarm, contextlib.ExitStack() as stack:
        # one client per user (a client model runs one generation at a time)
        models = [stack.enter_context(connected_model(tiny_model_dir, swarm)) for _ in range(SESSIONS)]
        start = threading.Barrier(SESSIONS)

        def generate(index: int) -> None:
            try:
                start.wait(30)
                outputs[index] = models[index].generate(prompts[index], max_new_tokens=NEW_TOKENS, do_sample=False)
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
        sizes = [int(size) for size in BATCH_LINE.findall(log)]
        assert sizes and max(sizes) > 1, log[-2000:]
    print(f"{SESSIONS} sessions x {NEW_TOKENS} tokens in {elapsed:.2f} s; batch sizes {sizes}")
