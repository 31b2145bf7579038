"""Unit tests of the model fingerprint: stable for one checkpoint, different for another, cheap to compute."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarmlm.errors import ModelLoadError
from swarmlm.models.fingerprint import model_fingerprint
from tests.conftest import build_tiny_llama


@pytest.fixture(scope="module")
def other_seed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-seed1"), seed=1)


def test_same_checkpoint_same_fingerprint(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    assert model_fingerprint(tiny_model_dir) == model_fingerprint(copy)
    # paths, transformers version and other non-architecture config fields do not matter
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.0"
    config["_name_or_path"] = "/somewhere/else"
    (copy / "config.json").write_text(json.dumps(config, indent=1))
    assert model_fingerprint(tiny_model_dir) == model_fingerprint(copy)


def test_resharding_keeps_the_fingerprint(tiny_model_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tiny_model_dir / "config.json", sharded / "config.json")
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert model_fingerprint(sharded) == model_fingerprint(tiny_model_dir)


def test_another_model_of_the_same_shape_differs(tiny_model_dir: Path, other_seed_dir: Path) -> None:
    assert model_fingerprint(tiny_model_dir) != model_fingerprint(other_seed_dir)


def test_changed_config_or_weights_differ(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = model_fingerprint(tiny_model_dir)
    config_changed = Path(shutil.copytree(tiny_model_dir, tmp_path / "config"))
    config = json.loads((config_changed / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (config_changed / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(config_changed) != base

    weights_changed = Path(shutil.copytree(tiny_model_dir, tmp_path / "weights"))
    tensors = load_file(weights_changed / "model.safetensors")
    tensors["model.layers.2.self_attn.q_proj.weight"] = tensors["model.layers.2.self_attn.q_proj.weight"] + 1e-3
    save_file(tensors, weights_changed / "model.safetensors", metadata={"format": "pt"})
    assert model_fingerprint(weights_changed) != base

    other_dtype = Path(shutil.copytree(tiny_model_dir, tmp_path / "bf16"))
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, other_dtype / "model.safetensors")
    assert model_fingerprint(other_dtype) != base


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_activation", "gelu"), ("rope_local_base_freq", 1e4), ("attn_logit_softcapping", 50.0)],
)
def test_family_fields_that_change_the_blocks_change_the_fingerprint(
    tiny_model_dir: Path, tmp_path: Path, field: str, value: object
) -> None:
    """Fields only some families have (here Gemma's) are hashed when present: servers whose configs differ in one
    would compute different blocks, so they must not share a swarm."""
    first, second = (Path(shutil.copytree(tiny_model_dir, tmp_path / name)) for name in ("first", "second"))
    config = json.loads((first / "config.json").read_text())
    (first / "config.json").write_text(json.dumps({**config, field: value}))
    (second / "config.json").write_text(json.dumps({**config, field: f"{value}-other"}))
    assert len({model_fingerprint(tiny_model_dir), model_fingerprint(first), model_fingerprint(second)}) == 3


def test_reads_only_samples_of_large_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    big = tmp_path / "big"
    big.mkdir()
    shutil.copy(tiny_model_dir / "config.json", big / "config.json")
    save_file({f"w{i}": torch.zeros(4096, 4096) for i in range(2)}, big / "model.safetensors")  # 128 MB
    began = time.perf_counter()
    model_fingerprint(big)
    assert time.perf_counter() - began < 0.5


def test_not_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        model_fingerprint(tmp_path)
