"""Unit tests of the DHT prefix derived from a model's name."""

import pytest

from swarmlm.models.naming import default_dht_prefix


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
    assert default_dht_prefix("/models/Qwen2.5-0.5B-Instruct.Q8_0.gguf") == "qwen2-5-0-5b-instruct"
    assert default_dht_prefix("") == "model"
