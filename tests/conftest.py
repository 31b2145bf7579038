"""Shared fixtures: tiny random and real models, local reference models, and real swarms on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from swarmlm import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.tools import prefork
from swarmlm.tools.local_swarm import LocalSwarm
from swarmlm.tools.soak import started_since

# servers of the tests' swarms are forked from a process that imported the server's code once (tools/prefork.py):
# about 4 s of CPU less per server, of the ~190 the suite starts; tests/integration/test_processes.py checks both ways
os.environ.setdefault(prefork.ENV_SWITCH, "1")
# servers log each request and step (`serve --log-requests`): tests read from the logs which server served what
os.environ.setdefault("SWARMLM_LOG_REQUESTS", "1")
# one compute thread in each test process and in the processes the tests start (API, demo, CLI): the suite runs on
# more workers than cores, and torch's second thread mostly waits on the first there (a 20-token local greedy decode
# of SmolLM2 costs 1.44 s of CPU on two threads, 1.16 s on one, and far more on a loaded machine)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# The longest modules, longest first (module wall time under `-n 3 --dist loadfile`, bench/test_times.py): the
# workers take whole modules in collection order (dev.sh passes --no-loadscope-reorder, since xdist's own order, by
# test count, left the long one-test modules to the end, where one worker ran them while the others sat idle)
LONGEST_FIRST = (
    "test_api.py", "test_docs.py", "test_generation.py", "test_public_swarm.py", "test_hub.py",
    "test_combinations.py", "test_inflight_failover.py", "test_restarts.py", "test_chaos.py", "test_families.py",
    "test_lm_eval.py", "test_soak.py", "test_loading.py", "test_simulate.py", "test_demo_chat.py",
    "test_network_swarm.py", "test_speculative.py", "test_fair_hosts.py", "test_forward_smollm.py", "test_training.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in LONGEST_FIRST run first, in that order; the others keep their order (the sort is stable)."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# fp32 logits through the swarm must match a local run this closely
LOGITS_ATOL = 1e-4


def build_tiny_llama(folder: Path, num_layers: int = 5, seed: int = 0) -> Path:
    """A random Llama with grouped-query attention (4 heads, 2 KV heads) and an odd number of layers."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The bundled SmolLM2, converted once into the default cache (later runs reuse it)."""
    return resolve_model(DEFAULT_MODEL)


def load_reference(model_dir: Path) -> torch.nn.Module:
    """The local model in fp32, with the attention implementation the servers run (sdpa; eager for Gemma 2)."""
    attention = load_config(model_dir)._attn_implementation
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention, dtype=torch.float32).eval()


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread in this process for a while (a local reference model beside a swarm's servers): on a loaded
    machine two threads waiting on each other at every operation made a small model ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def running_swarm(model: str | Path, spans: Sequence[tuple[int, int]], **kwargs: object) -> Iterator[LocalSwarm]:
    """Servers for `spans` on 127.0.0.1 (one compute thread each: the machine has two cores)."""
    swarm = LocalSwarm(str(model), threads_per_server=1, **kwargs)
    try:
        swarm.start_servers(spans)
        yield swarm
    finally:
        swarm.close()


@contextmanager
def connected_model(model: str | Path, swarm: LocalSwarm, **options: object) -> Iterator[torch.nn.Module]:
    options.setdefault("request_timeout_s", 30.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(model), initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix, **options
    )
    try:
        yield model
    finally:
        model.close()


def descendants() -> list[psutil.Process]:
    """Live processes started (directly or not) by this test process, except torch's and multiprocessing's own
    helpers and the server forkers (the soak's check, tools/soak.py, with nothing started before)."""
    return started_since(set())


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """The run fails if any process its tests started (servers, DHT nodes, p2pd) is still running once every other
    fixture has stopped: set up first, this is torn down last, in each parallel worker (pytest-xdist) as in a plain
    run, and its error fails the run there too."""
    yield
    prefork.close_all()  # the forkers that started servers (SWARMLM_PREFORK) live as long as the run
    gone, alive = psutil.wait_procs(descendants(), timeout=10)
    if alive:
        names = ", ".join(f"{p.pid}:{p.name()} ({' '.join(p.cmdline())[:200]})" for p in alive)
        for process in alive:
            process.kill()
        pytest.fail(f"processes left behind by the tests: {names}", pytrace=False)
