"""A model's names: the swarm name (DHT prefix) its servers and clients meet under, and the name pages show.

Both come from the model's identity, a file or folder name, whichever way the model is given: the bundled name,
its .gguf file anywhere, the folder that file was converted into, a Hugging Face folder, or a Hub repository's
snapshot (its name and commit). Neither ever holds a
path, so no page or DHT record shows where a model lies on some disk.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from swarmlm.models.hub import hub_origin
from swarmlm.models.loading import converted_from, known_gguf_name

# GGUF quantization suffixes ("Q4_1", "Q4_K_M", "IQ2_XS", "F16", "BF16", ...): dropped, since every quantization of
# a model is converted to the same float weights and so joins the same swarm (the fingerprint tells them apart).
_GGUF_QUANT = re.compile(r"\.(?:i?q\d+(?:_[a-z0-9]+)*|f16|f32|bf16)$", re.IGNORECASE)
_EXTENSION = re.compile(r"\.gguf$", re.IGNORECASE)
# folders converted by versions that wrote no record of their source: "<gguf stem>-<16 hex digits>"
_UNRECORDED_CONVERSION = re.compile(r"^(?P<stem>.+)-[0-9a-f]{16}$")
# a Hugging Face hub download: .../models--<org>--<name>/snapshots/<revision>
_HUB_REPO_PREFIX = "models--"
# hex digits of a Hub snapshot's commit in its swarm name: 32 bits tell apart the revisions of one repository
HUB_COMMIT_HEX_DIGITS = 8


@dataclass(frozen=True)
class ModelName:
    display: str  # shown by pages, the catalog and /v1/models, e.g. "SmolLM2-135M-Instruct"
    swarm: str  # the default DHT prefix, e.g. "smollm2-135m-instruct"


def model_name(model: str | os.PathLike) -> ModelName:
    """The names of `model` (a bundled name, a .gguf file, a converted or Hugging Face folder), alike for every way
    of naming the same model: 'smollm2-135m-instruct', '/x/SmolLM2-135M-Instruct.Q4_1.gguf', the folder that file
    was converted into and '/y/SmolLM2-135M-Instruct/' all give ('SmolLM2-135M-Instruct', 'smollm2-135m-instruct').

    A path that does not exist is named by its text alone.
    A Hub snapshot (a repository's folder in the Hub cache, as `resolve_model("org/name")` gives) is shown by its
    repository's name, and its swarm name ends with the first HUB_COMMIT_HEX_DIGITS hex digits of its commit:
    servers of two revisions of one repository never meet in one swarm.
    """
    origin = _hub_snapshot(model)
    if origin is not None:
        names = name_from_identity(origin[0])
        return ModelName(display=names.display, swarm=f"{names.swarm}-{origin[1][:HUB_COMMIT_HEX_DIGITS]}")
    return name_from_identity(_identity(model))


def default_dht_prefix(model: str | os.PathLike) -> str:
    """The swarm name of `model` (see model_name)."""
    return model_name(model).swarm


def name_from_identity(identity: str) -> ModelName:
    """The names for a file or folder name (only its last component counts), without looking at any disk.

    The display name drops the GGUF extension and quantization suffix; the swarm name is it lower-cased with every
    run of other characters than letters and digits turned into '-'. Dots inside a name are version numbers
    ('Llama-3.1-8B', 'Qwen2.5-0.5B') and become '-' too, so models differing only after a dot never share a swarm.
    """
    name = re.split(r"[/\\]", identity.rstrip("/\\"))[-1]
    display = _GGUF_QUANT.sub("", _EXTENSION.sub("", name)).strip() or "model"
    swarm = re.sub(r"[^a-z0-9]+", "-", display.lower()).strip("-")
    return ModelName(display=display, swarm=swarm or "model")


def _hub_snapshot(model: str | os.PathLike) -> tuple[str, str] | None:
    """(repository, commit) of a Hub snapshot folder; None for anything else."""
    text = os.fspath(model)
    if not text or (isinstance(model, str) and known_gguf_name(text) is not None):
        return None
    path = Path(text).expanduser()
    return hub_origin(path.resolve()) if path.is_dir() else None


def _identity(model: str | os.PathLike) -> str:
    """The file or folder name that names `model`."""
    text = os.fspath(model)
    known = known_gguf_name(text) if isinstance(model, str) else None
    if known is not None:
        return known
    path = Path(text).expanduser()
    if not text or not path.exists():
        return text
    if not path.is_dir():
        # a file's own name, not its target's: a hub download links model.Q4_K_M.gguf to a blob named by its hash
        return path.name
    return _folder_identity(path.resolve())


def _folder_identity(folder: Path) -> str:
    """A converted folder's source file, a hub download's repository name, or else the folder's own name."""
    source = converted_from(folder)
    if source is not None:
        return source
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(_HUB_REPO_PREFIX):
        return folder.parent.parent.name.split("--", 2)[-1]
    unrecorded = _UNRECORDED_CONVERSION.match(folder.name)
    return unrecorded["stem"] if unrecorded is not None else folder.name
