"""Forward and backward requests of different clients over the same blocks run joined on the server, and each
client still gets exactly its own results."""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from pathlib import Path

import torch

from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm

CLIENTS = 2
ROUNDS = 3
BATCH_LINE = re.compile(r"(forward|backward) batch requests=(\d+) peers=(\d+) blocks=")


def test_two_clients_forwards_and_backwards_run_joined_and_exact(tiny_model_dir: Path) -> None:
    reference = load_reference(tiny_model_dir)
    generator = torch.Generator().manual_seed(8)
    # each client's batch goes as concurrent one-row sub-batches (max_tokens_per_request): many arrive together
    ids = [torch.randint(0, 128, (4, 6), generator=generator) for _ in range(CLIENTS)]
    with torch.inference_mode():
        expected = [reference(x).logits for x in ids]
    hidden = [torch.randn(4, 6, 64, generator=generator) for _ in range(CLIENTS)]
    weights = torch.randn(4, 6, 64, generator=generator)
    expected_grads = []
    for h in hidden:
        local = h.clone().requires_grad_()
        positions = torch.arange(6).unsqueeze(0).expand(4, -1)
        out, rotary = local, reference.model.rotary_emb(local, positions)
        for layer in reference.model.layers:
            out = layer(out, position_embeddings=rotary, position_ids=positions)
        (out * weights).sum().backward()
        expected_grads.append(local.grad)
    errors: list[BaseException] = []
    # a forward keeps its graph only when it runs alone, and the backward from a kept graph joins no other
    # (server/activations.py): with nothing kept, every forward and backward may join
    with running_swarm(tiny_model_dir, [(0, 5)], extra_args=["--activation-cache-mb", "0"]) as swarm, \
            contextlib.ExitStack() as stack:  # fmt: skip
        models = [stack.enter_context(connected_model(tiny_model_dir, swarm, max_tokens_per_request=6))
                  for _ in range(CLIENTS)]  # fmt: skip
        # the clients start each round together when the test's thread says so: `ready` when done with the last
        ready, go = threading.Barrier(CLIENTS + 1), threading.Barrier(CLIENTS + 1)

        def work(index: int) -> None:
            try:
                for _ in range(ROUNDS):
                    ready.wait(120)
                    go.wait(60)
                    logits = models[index](ids[index]).logits
                    assert (logits - expected[index]).abs().max().item() <= LOGITS_ATOL
                    remote = hidden[index].clone().requires_grad_()
                    (models[index].model.layers(remote) * weights).sum().backward()
                    want = expected_grads[index]
                    assert (remote.grad - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-7
            except BaseException as e:  # noqa: BLE001 - reported by the test's thread
                errors.append(e)
                ready.abort()  # the test's thread stops waiting for the rounds
                go.abort()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        server = swarm.servers[0].process
        for round_ in range(ROUNDS):
            # a server that is behind finds both clients' requests waiting: in one round it is briefly stopped
            # while they arrive (else the first client's requests may run before the second's arrive, and the
            # two then keep alternating on a loaded machine); the first round has found the routes
            frozen = round_ == 1
            with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: its error is reported
                ready.wait(120)
                if frozen:
                    server.send_signal(signal.SIGSTOP)
                try:
                    go.wait(60)
                    if frozen:
                        time.sleep(2.0)
                finally:
                    if frozen:
                        server.send_signal(signal.SIGCONT)
        for thread in threads:
            thread.join(120)
        log = swarm.servers[0].log_path.read_text()
    assert not errors, errors
    joined = [(kind, int(requests), int(peers)) for kind, requests, peers in BATCH_LINE.findall(log)]
    assert any(kind == "forward" and requests > 1 for kind, requests, _ in joined), log[-3000:]
    assert any(kind == "backward" and requests > 1 for kind, requests, _ in joined), log[-3000:]
    assert any(peers == CLIENTS for _, _, peers in joined), joined  # requests of both clients in one computation
    print(f"joined computations (kind, requests, peers): {joined}")
