"""Unit tests of a model's names (models/naming.py): every way of naming one model gives one swarm name and one display
name, neither holding a path."""

from pathlib import Path

import pytest

from swarmlm.models import loading
from swarmlm.models.loading import DEFAULT_MODEL, SOURCE_FILE, converted_from, resolve_model
from swarmlm.models.naming import ModelName, default_dht_prefix, model_name, name_from_identity

SMOLLM = ModelName(display="SmolLM2-135M-Instruct", swarm="smollm2-135m-instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _fake_conversion(gguf: Path, out_dir: Path) -> None:
    """Stands in for the 30 s dequantization: what the cache checks of a converted folder."""
    (out_dir / "config.json").write_text("{}")
    (out_dir / "model.safetensors").write_bytes(b"")


def _ways_of_naming_smollm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The bundled name, its GGUF file here and elsewhere, the folder that file is converted into (also renamed), one
    converted by an older version (no record of its source), a Hugging Face folder and a hub download."""
    copy = tmp_path / "elsewhere" / GGUF_NAME
    copy.parent.mkdir()
    copy.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    monkeypatch.setattr(loading, "_convert_gguf", _fake_conversion)
    converted = resolve_model(copy, cache_dir=tmp_path / "cache")
    renamed = converted.rename(tmp_path / "cache" / "renamed-by-hand")
    unrecorded = tmp_path / "SmolLM2-135M-Instruct.Q4_1-67a8d84c73f6872c"
    unrecorded.mkdir()
    (unrecorded / "config.json").write_text("{}")
    hf_folder = tmp_path / "SmolLM2-135M-Instruct"
    hf_folder.mkdir()
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    blob = tmp_path / "hub" / "3f9c0b2e1d"
    blob.write_bytes(b"GGUF")
    (snapshot / GGUF_NAME).symlink_to(blob)
    return [
        DEFAULT_MODEL, DEFAULT_MODEL.upper(), str(loading._bundled_gguf(DEFAULT_MODEL)), str(copy), str(renamed),
        str(unrecorded), f"{hf_folder}/", str(snapshot), str(snapshot / GGUF_NAME), f"/nowhere/{GGUF_NAME}",
        "/nowhere/SmolLM2-135M-Instruct.Q8_0.gguf", "SmolLM2-135M-Instruct.Q4_K_M.gguf",
    ]  # fmt: skip


def test_every_way_of_naming_one_model_gives_one_name_without_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ways = _ways_of_naming_smollm(tmp_path, monkeypatch)
    assert converted_from(Path(ways[4])) == GGUF_NAME
    for way in ways:
        assert model_name(way) == SMOLLM, way
        assert default_dht_prefix(way) == SMOLLM.swarm
    for way in ways[2:]:  # paths (a known name is a str: a Path is always a path, as resolve_model takes it)
        assert model_name(Path(way)) == SMOLLM, way
    assert name_from_identity(SMOLLM.display) == SMOLLM  # a display name read back (the monitor does) is unchanged


def test_a_source_record_that_is_no_file_name_is_ignored(tmp_path: Path) -> None:
    folder = tmp_path / "Tiny-Llama"
    folder.mkdir()
    for bad in ['{"gguf": "/etc/passwd"}', '{"gguf": "../x.gguf"}', '{"gguf": 3}', "{", '{"other": "a.gguf"}']:
        (folder / SOURCE_FILE).write_text(bad)
        assert converted_from(folder) is None
        assert model_name(folder) == ModelName("Tiny-Llama", "tiny-llama")


@pytest.mark.parametrize(
    "identity",
    [
        "/home/someone/.cache/swarmlm/SmolLM2-135M-Instruct.Q4_1-67a8d84c73f6872c",  # an older server's catalog entry
        "C:\\models\\Qwen2.5-0.5B-Instruct.Q8_0.gguf",
        "/srv/models/Llama-3.1-8B/",
        "",
        "/",
    ],
)
def test_names_never_hold_a_path(identity: str) -> None:
    name = name_from_identity(identity)
    for text in (name.display, name.swarm):
        assert text and "/" not in text and "\\" not in text and "models" not in text


@pytest.mark.parametrize(
    "model",
    [
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "/x/SmolLM2-135M-Instruct.Q4_1.gguf",
        "/y/SmolLM2-135M-Instruct/",
        "SmolLM2-135M-Instruct.Q4_K_M.gguf",
        "SmolLM2-135M-Instruct.IQ2_XS.gguf",
        "SmolLM2-135M-Instruct.F16.gguf",
        "SmolLM2-135M-Instruct.BF16.gguf",
        "SmolLM2-135M-Instruct.gguf",
    ],
)
def test_same_model_same_prefix(model: str) -> None:
    assert default_dht_prefix(model) == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    "first, second",
    [
        ("Llama-3.1-8B", "Llama-3.2-1B"),
        ("Qwen2.5-7B", "Qwen2.5-0.5B"),
        ("/m/Llama-3.1-8B-Instruct.Q4_K_M.gguf", "/m/Llama-3.2-8B-Instruct.Q4_K_M.gguf"),
        ("Qwen2.5-0.5B/", "Qwen2-0.5B/"),
    ],
)
def test_different_models_never_share_a_prefix(first: str, second: str) -> None:
    assert default_dht_prefix(first) != default_dht_prefix(second)


def test_version_dots_are_kept_as_separators() -> None:
    assert default_dht_prefix("Llama-3.1-8B") == "llama-3-1-8b"
    assert model_name("/models/Qwen2.5-0.5B-Instruct.Q8_0.gguf") == ModelName(
        "Qwen2.5-0.5B-Instruct", "qwen2-5-0-5b-instruct"
    )
    assert default_dht_prefix("") == "model"
