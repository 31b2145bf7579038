"""Models by Hub repository id, through a local Hub-compatible endpoint (tests/hub.py) over real HTTP: servers and a
client each fetch only the shards holding their tensors, byte for byte, and answer as transformers does on the same
checkpoint; restarts run offline from the cache; revisions never mix; a disk budget evicts unneeded shards; a .gguf
in a repository converts as a local one; every Hub error is one line and exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest
import torch
from huggingface_hub import constants, file_download, hf_hub_download
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from swarmlm import AutoDistributedModelForCausalLM
from swarmlm.errors import ModelLoadError
from swarmlm.models.fingerprint import model_fingerprint
from swarmlm.models.loading import converted_from, load_tensors, resolve_model
from swarmlm.models.naming import model_name
from swarmlm.tools import prefork
from swarmlm.tools.demo import attach_lines
from swarmlm.tools.local_swarm import LocalServer, LocalSwarm
from tests.conftest import LOGITS_ATOL, load_reference
from tests.hub import LocalHub
from tests.integration.test_cli_errors import RUN_TAG
from tests.integration.test_cli_errors import _tagged as tagged

REPO = "org/tiny"
GATED = "org/gated"
TOKEN = "hf_test_token"
NUM_LAYERS = 6
# small enough that blocks spread over several shards (one block's tensors are ~150 KB in float32)
SHARD_SIZE = "160KB"
SWARMLM = [sys.executable, "-m", "swarmlm.cli.main"]
NEW_TOKENS = 6
PROMPT = "What is the capital of France?"
# a CLI run that fails on its model ends within this (imports and a few HTTP requests on a busy 2-core machine)
CLI_TIMEOUT_S = 180
# the demo starts two servers and a client
DEMO_TIMEOUT_S = 420
SERVER_BLOCKS = ("model.layers.",)
CLIENT_PREFIXES = ("model.embed_tokens.", "model.norm.", "lm_head.")
ONE_LINE_ERROR = re.compile(r"^swarmlm: error: .+$")


def build_checkpoint(folder: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A random Llama of NUM_LAYERS blocks with SmolLM2's tokenizer (and its vocabulary, so that the tokenizer and
    its chat template work), saved in shards of SHARD_SIZE, as checkpoints on the Hub are."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(folder)
    return folder


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def shards_for(folder: Path, prefixes: Sequence[str]) -> set[str]:
    """The shards holding the tensors whose names start with one of `prefixes`, per the index."""
    return {file for name, file in weight_map(folder).items() if name.startswith(tuple(prefixes))}


def blocks(start: int, end: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}." for i in range(start, end))


def small_files(folder: Path) -> set[str]:
    """What every process fetches: config, tokenizer, generation config, weight index (all but the weights)."""
    return {file.name for file in folder.iterdir() if not file.name.endswith(".safetensors")}


@pytest.fixture(scope="module")
def checkpoint(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_checkpoint(tmp_path_factory.mktemp("hub-tiny"), smollm_dir, seed=0)
    # the checkpoint this test needs: blocks spread over shards, no shard holding every block
    assert len(set(weight_map(folder).values())) >= 4
    assert shards_for(folder, blocks(0, 3)) != shards_for(folder, blocks(3, 6))
    return folder


@pytest.fixture(scope="module")
def checkpoint_v2(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("hub-tiny-v2"), smollm_dir, seed=1)


@pytest.fixture(scope="module")
def odd_repos(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> dict[str, Path]:
    """Repositories that are no model swarmlm serves: pickle weights only, an unsupported family."""
    pickle = tmp_path_factory.mktemp("hub-pickle")
    (pickle / "config.json").write_text((checkpoint / "config.json").read_text())
    (pickle / "pytorch_model.bin").write_bytes(b"not really a pickle")
    bert = tmp_path_factory.mktemp("hub-bert")
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 2}))
    (bert / "model.safetensors").write_bytes(bytes(64))
    return {"org/pickle": pickle, "org/bert": bert}


@pytest.fixture(scope="module")
def hub(checkpoint: Path, checkpoint_v2: Path, odd_repos: dict[str, Path]) -> Iterator[LocalHub]:
    with LocalHub() as hub:
        hub.add_repo(REPO, checkpoint)
        hub.add_revision(REPO, checkpoint_v2, "v2")
        hub.add_repo(GATED, checkpoint, gated=True, token=TOKEN)
        for repo, folder in odd_repos.items():
            hub.add_repo(repo, folder)
        yield hub


@pytest.fixture
def hub_env(hub: LocalHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> LocalHub:
    """This process and the processes it starts use the local Hub and a fresh Hub cache, online, with no token."""
    hub.use_in_process(monkeypatch, tmp_path / "client-cache")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.clear()
    return hub


def fetched_files(hub: LocalHub) -> list[str]:
    """The files whose content the Hub sent (sorted), each checked to have been sent whole, in one response."""
    sent = [f for f in hub.fetched if f.method == "GET" and f.status in (200, 206)]
    for fetch in sent:
        size = len(hub.repos[fetch.repo].files[str(fetch.commit)][fetch.path].data)
        assert fetch.served == (0, size) and fetch.sent == size, fetch
    return sorted(f.path for f in sent)


def bytes_fetched(hub: LocalHub) -> int:
    return sum(f.sent for f in hub.fetched if f.method == "GET" and f.status in (200, 206))


def cached_files(cache: Path, repo: str = REPO) -> dict[str, bytes]:
    """The files of the snapshots of `repo` in the Hub cache `cache`, by name."""
    folder = cache / f"models--{repo.replace('/', '--')}" / "snapshots"
    return {file.name: file.read_bytes() for snapshot in folder.iterdir() for file in snapshot.iterdir()}


def start_server(
    swarm: LocalSwarm, monkeypatch: pytest.MonkeyPatch, cache: Path, start: int, end: int, *extra: str
) -> LocalServer:
    """A `swarmlm serve org/tiny` server with its own Hub cache (servers inherit this process's environment)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return swarm.add_server(start, end, extra_args=list(extra))


def check_same_as_local(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    ids = torch.tensor([[1, 17, 400, 9000, 33, 2048, 5]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=LOGITS_ATOL, rtol=0)
        expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)


def test_servers_and_a_client_by_repo_id_fetch_only_their_shards(
    hub_env: LocalHub, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hub = hub_env
    reference = load_reference(checkpoint)
    caches = {name: tmp_path / name for name in ("first", "second")}
    first_needs, second_needs = shards_for(checkpoint, blocks(0, 3)), shards_for(checkpoint, blocks(3, 6))
    # the second server's cache holds shards only the first server needs: its disk budget evicts them
    only_first = sorted(first_needs - second_needs)
    for shard in only_first:
        hf_hub_download(REPO, shard, cache_dir=caches["second"])
    hub.clear()
    with LocalSwarm(REPO, threads_per_server=1) as swarm:
        first = start_server(swarm, monkeypatch, caches["first"], 0, 3)
        assert fetched_files(hub) == sorted(small_files(checkpoint) | first_needs)
        first_bytes = bytes_fetched(hub)
        hub.clear()
        start_server(swarm, monkeypatch, caches["second"], 3, 6, "--max-disk-space", "0.000001")
        assert fetched_files(hub) == sorted(small_files(checkpoint) | second_needs)
        second_bytes = bytes_fetched(hub)
        held = {name for name in cached_files(caches["second"]) if name.endswith(".safetensors")}
        assert held == second_needs  # what it was given and does not need is gone; what it serves stays
        hub.clear()
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "client-cache"))
        with AutoDistributedModelForCausalLM.from_pretrained(
            REPO, initial_peers=swarm.initial_peers, request_timeout_s=30.0
        ) as model:
            client_needs = shards_for(checkpoint, CLIENT_PREFIXES)
            assert fetched_files(hub) == sorted(small_files(checkpoint) | client_needs)
            client_bytes = bytes_fetched(hub)
            check_same_as_local(model, reference)
        # every file any process holds is the repository's, byte for byte
        for cache in [*caches.values(), tmp_path / "client-cache"]:
            for name, data in cached_files(cache).items():
                assert data == (checkpoint / name).read_bytes(), name
        total = sum(file.stat().st_size for file in checkpoint.iterdir())
        print(f"\nfetched: server 0:3 {first_bytes} B, server 3:6 {second_bytes} B, client {client_bytes} B; "
              f"repository {total} B")  # fmt: skip
        log = Path(first.log_path).read_text()
        assert any(shard in log for shard in first_needs), log[-2000:]  # a progress bar per file, by name

        # a restart with HF_HUB_OFFLINE=1 runs from the cache, without a single request to the Hub
        swarm.stop_server(first)
        hub.clear()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        start_server(swarm, monkeypatch, caches["first"], 0, 3)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "client-cache"))
        with AutoDistributedModelForCausalLM.from_pretrained(
            REPO, initial_peers=swarm.initial_peers, request_timeout_s=30.0
        ) as model:
            check_same_as_local(model, reference)
        assert hub.requests == []


def test_revisions_resolve_to_their_commits_and_never_share_a_swarm(hub_env: LocalHub, checkpoint_v2: Path) -> None:
    main = resolve_model(REPO)
    v2 = resolve_model(REPO, revision="v2")
    by_commit = resolve_model(REPO, revision=v2.name)
    assert main != v2 == by_commit
    assert model_name(main).display == model_name(v2).display == "tiny"
    assert model_name(main).swarm == f"tiny-{main.name[:8]}" != model_name(v2).swarm
    assert model_fingerprint(main) != model_fingerprint(v2) == model_fingerprint(by_commit)
    # the fingerprint follows the commit: no weight file was needed to compute it
    assert not any(name.endswith(".safetensors") for name in fetched_files(hub_env))
    torch.testing.assert_close(
        load_tensors(v2, ["model.norm."])["model.norm.weight"],
        load_tensors(checkpoint_v2, ["model.norm."])["model.norm.weight"],
    )


def test_an_interrupted_download_resumes(hub_env: LocalHub, checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection cut in the middle of a shard: the download goes on from the last whole chunk it received (10 MiB
    by default: 1 KiB here, with no pause before resuming, to keep the test small)."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda _seconds: None))
    folder = resolve_model(REPO)
    shard = sorted(shards_for(checkpoint, ["model.norm."]))[0]
    size = (checkpoint / shard).stat().st_size
    hub_env.clear()
    hub_env.cut_next_download(REPO, shard, after=size // 3)
    load_tensors(folder, ["model.norm."])
    gets = [f for f in hub_env.fetched if f.method == "GET" and f.path == shard]
    resumed_at = size // 3 // 1024 * 1024  # the whole chunks received before the cut
    assert [(f.status, f.range) for f in gets] == [(200, None), (206, f"bytes={resumed_at}-")]
    assert gets[1].sent == size - resumed_at
    assert (folder / shard).read_bytes() == (checkpoint / shard).read_bytes()


def test_a_gated_repository_opens_with_its_token(hub_env: LocalHub, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="gated and no token is set: .*HF_TOKEN"):
        resolve_model(GATED)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = resolve_model(GATED)
    assert "model.norm.weight" in load_tensors(folder, ["model.norm."])


def test_a_gguf_file_in_a_repository_converts_as_a_local_one(
    hub_env: LocalHub, smollm_dir: Path, tmp_path: Path
) -> None:
    """The bundled GGUF file served from a repository: by file name and by quantization, it resolves to the folder
    its local copy converted into (smollm_dir, found again by the file's name and content: no second conversion)."""
    gguf = converted_from(smollm_dir)
    assert gguf is not None
    from swarmlm.models.loading import _bundled_gguf

    repo_folder = tmp_path / "gguf-repo"
    repo_folder.mkdir()
    (repo_folder / gguf).symlink_to(_bundled_gguf("smollm2-135m-instruct"))
    hub_env.add_repo("org/smol-gguf", repo_folder)
    assert resolve_model(f"org/smol-gguf/{gguf}", cache_dir=smollm_dir.parent) == smollm_dir
    assert resolve_model("org/smol-gguf:Q4_1", cache_dir=smollm_dir.parent) == smollm_dir
    assert fetched_files(hub_env) == [gguf]  # downloaded once: the second name found it in the cache
    with pytest.raises(ModelLoadError, match="0 .gguf files of quantization Q8_0"):
        resolve_model("org/smol-gguf:Q8_0")
    with pytest.raises(ModelLoadError, match="no safetensors weights but .gguf files"):
        resolve_model("org/smol-gguf")


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`swarmlm ARGS` run to its end with `env`: forked when the suite forks (tools/prefork.py), from a forker that
    imported huggingface_hub with this same environment (its endpoint and cache are read at import)."""
    if prefork.enabled():
        return prefork.run([*SWARMLM, *args], env, CLI_TIMEOUT_S)
    return subprocess.run([*SWARMLM, *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env)


@pytest.fixture(scope="module")
def errors_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What every error case's command runs with besides the local Hub: one Hub cache and one tag (marking every
    process the commands start, so that none can hide) for all, so that they share one forker; the cases fail before
    any weights are fetched, and run one after the other."""
    return {"HF_HUB_CACHE": str(tmp_path_factory.mktemp("errors-cache")), RUN_TAG: uuid.uuid4().hex}


ERRORS = [
    ("unknown-repo", "org/nothing", {}, r"No model 'org/nothing' on http://127\.0\.0\.1:\d+: check the name"),
    ("gated-without-token", GATED, {}, r"org/gated is gated and no token is set: accept its licence .* HF_TOKEN"),
    ("bad-revision", f"{REPO} --revision nope", {}, r"org/tiny has no revision 'nope'"),
    ("pickle-weights", "org/pickle", {}, r"org/pickle has only PyTorch pickle weights"),
    ("unsupported-family", "org/bert", {}, r"model_type 'bert' is not supported yet"),
    ("offline-not-cached", REPO, {"HF_HUB_OFFLINE": "1"}, r"org/tiny is not \(wholly\) in the Hub cache .* "
     r"HF_HUB_OFFLINE is set"),
    ("not-a-repo-id", "org/a/b", {}, r"model org/a/b: no such file or folder, nor a Hub repository"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "env", "expected"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_hub_errors_are_one_line(
    hub_env: LocalHub, errors_env: dict[str, str], model: str, env: dict[str, str], expected: str
) -> None:
    result = run_cli(["serve", *model.split(), "--blocks", "0:1", "--new-swarm"], {**os.environ, **errors_env, **env})
    forkers = prefork.forker_pids()  # helpers that outlive every command by design (their environment has the tag)
    _, left = psutil.wait_procs([p for p in tagged(errors_env[RUN_TAG]) if p.pid not in forkers], timeout=10)
    for process in left:  # fail, but leave nothing to the next tests
        process.kill()
    assert left == [], [process.cmdline() for process in left]
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines and ONE_LINE_ERROR.match(lines[-1]), result.stderr[-3000:]
    assert re.search(expected, lines[-1]), lines[-1]


def test_demo_by_repo_id_answers_as_transformers_does(hub_env: LocalHub, checkpoint: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        out = load_reference(checkpoint).generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "demo-cache")}
    result = subprocess.run(
        [*SWARMLM, "demo", REPO, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)],
        capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Assistant: {expected}" in result.stdout, result.stdout[-2000:]
    assert "The swarm stops now" in result.stdout  # a one-shot demo invites no one to attach
    # in chat and API modes the demo says how to attach, by the name it was given (and its revision)
    attach = attach_lines(REPO, ["/ip4/127.0.0.1/tcp/1/p2p/x"], "v2")
    assert f"from_pretrained('{REPO}'" in attach and "revision='v2'" in attach and "--revision v2" in attach
    # the demo's servers and client share one cache: together they fetched each file once, and every file
    assert fetched_files(hub_env) == sorted(small_files(checkpoint) | set(weight_map(checkpoint).values()))
