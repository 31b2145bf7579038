"""The swarm name of a model: servers and clients given the same model meet under the same DHT prefix."""

from __future__ import annotations

import os
import re
from pathlib import Path


def default_dht_prefix(model: str | os.PathLike) -> str:
    """'smollm2-135m-instruct', '/x/SmolLM2-135M-Instruct.Q4_1.gguf' and '/y/SmolLM2-135M-Instruct/' all map to
    'smollm2-135m-instruct': the name without folders, quantization suffix or extension, lower-cased."""
    name = Path(str(model).rstrip("/\\")).name
    name = name.split(".", 1)[0] if name else str(model)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "model"
