"""The swarm name of a model: servers and clients given the same model meet under the same DHT prefix."""

from __future__ import annotations

import os
import re
from pathlib import Path

# GGUF quantization suffixes ("Q4_1", "Q4_K_M", "IQ2_XS", "F16", "BF16", ...): dropped, since every quantization of
# a model is converted to the same float weights and so joins the same swarm (the fingerprint tells them apart).
_GGUF_QUANT = re.compile(r"\.(?:i?q\d+(?:_[a-z0-9]+)*|f16|f32|bf16)$", re.IGNORECASE)
_EXTENSION = re.compile(r"\.gguf$", re.IGNORECASE)


def default_dht_prefix(model: str | os.PathLike) -> str:
    """'smollm2-135m-instruct', '/x/SmolLM2-135M-Instruct.Q4_1.gguf' and '/y/SmolLM2-135M-Instruct/' all map to
    'smollm2-135m-instruct': the whole name without folders, GGUF extension or quantization suffix, lower-cased.

    Dots inside the name are version numbers ('Llama-3.1-8B', 'Qwen2.5-0.5B') and become '-' like every other
    separator, so models differing only after a dot never share a prefix.
    """
    name = Path(str(model).rstrip("/\\")).name or str(model)
    name = _GGUF_QUANT.sub("", _EXTENSION.sub("", name))
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "model"
