"""`swarmlm serve --dtype auto`: the compute dtype comes from the checkpoint's config, float32 when it names none."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from swarmlm.errors import SwarmError
from swarmlm.server.server import serving_dtype


def test_auto_takes_the_dtype_the_checkpoint_names() -> None:
    assert serving_dtype("auto", LlamaConfig(dtype="bfloat16")) == "bfloat16"
    assert serving_dtype("auto", LlamaConfig(dtype=torch.float16)) == "float16"
    assert serving_dtype("auto", LlamaConfig(dtype="float32")) == "float32"


def test_auto_is_float32_when_the_checkpoint_names_no_dtype() -> None:
    config = LlamaConfig()
    assert getattr(config, "dtype", None) is None and getattr(config, "torch_dtype", None) is None
    assert serving_dtype("auto", config) == "float32"


def test_a_dtype_asked_for_wins_over_the_checkpoint() -> None:
    assert serving_dtype("float32", LlamaConfig(dtype="bfloat16")) == "float32"


def test_a_checkpoint_dtype_no_server_computes_in_is_an_error() -> None:
    with pytest.raises(SwarmError, match="cannot be served: pass --dtype float32"):
        serving_dtype("auto", LlamaConfig(dtype="float64"))
