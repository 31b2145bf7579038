"""A model's fingerprint: a short hash that every server and client loading the same checkpoint computes alike.

It covers the config's architecture fields and the weights' identity: every tensor's name, dtype and shape (from
the safetensors headers) plus a few bytes sampled from each tensor's data. It reads only the headers and
SAMPLE_BYTES at three places per tensor, never the weights in full, so it costs milliseconds even for large
checkpoints; and it does not depend on which tensors a process loads (servers load their blocks, clients the
embeddings and head) nor on how the tensors are sharded over files. A Hub snapshot is fingerprinted by its
repository and commit (see model_fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

from swarmlm.errors import ModelLoadError
from swarmlm.models.hub import hub_origin

# config.json fields that change what the blocks compute; other fields (paths, versions, dtype) are ignored
ARCHITECTURE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "hidden_act",
    "rms_norm_eps",
    "layer_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "tie_word_embeddings",
)
# fields of other families that change what their blocks compute; hashed only when config.json has them, so that
# the fingerprints of models without them stay what they were
FAMILY_FIELDS = (
    "layer_types",
    "use_sliding_window",
    "max_window_layers",
    "partial_rotary_factor",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "num_local_experts",
    "num_experts_per_tok",
    "hidden_activation",  # Gemma's MLP activation (its hidden_act is ignored when this is set)
    "rope_local_base_freq",  # Gemma 3's rotary base of its sliding-window layers
    "sliding_window_pattern",  # Gemma 3 configs that give the pattern instead of layer_types
    "use_bidirectional_attention",
)
# bytes read at the start, middle and end of each tensor: enough to tell apart any two trained or random checkpoints
SAMPLE_BYTES = 64
# hex digits kept: 128 bits, collision-free for any realistic number of models
FINGERPRINT_HEX_DIGITS = 32
# a safetensors header larger than this is corrupt (real ones are well under a few MB)
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def model_fingerprint(model_dir: str | Path) -> str:
    """The fingerprint of the Hugging Face folder `model_dir` (config.json and safetensors weights).

    A snapshot of a Hub repository is named by its repository and commit instead of its weights: a commit names
    its files' contents, and a process holds only some of the shards (servers of other blocks hold others), which
    it must not download in full to tell its checkpoint apart.
    """
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    digest.update(json.dumps(_architecture(model_dir), sort_keys=True).encode())
    origin = hub_origin(model_dir)
    if origin is not None:
        digest.update(json.dumps({"hub_repo": origin[0], "commit": origin[1]}).encode())
        return digest.hexdigest()[:FINGERPRINT_HEX_DIGITS]
    entries: list[tuple[str, bytes]] = []
    for file in _weight_files(model_dir):
        entries.extend(_file_entries(file))
    # sorted by tensor name: the same tensors split over other shards give the same fingerprint
    for _, entry in sorted(entries):
        digest.update(entry)
    return digest.hexdigest()[:FINGERPRINT_HEX_DIGITS]


def _architecture(model_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Cannot read {model_dir / 'config.json'}: {e}") from e
    fields = {key: config.get(key) for key in ARCHITECTURE_FIELDS}
    fields.update({key: config[key] for key in FAMILY_FIELDS if key in config})
    return fields


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"Cannot read the weight index {index}: {e}") from e
        return [model_dir / Path(name).name for name in sorted(names)]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No *.safetensors weights in {model_dir}.")
    return files


def _file_entries(file: Path) -> list[tuple[str, bytes]]:
    """(name, name + dtype + shape + sampled bytes) of every tensor in one safetensors file."""
    try:
        with open(file, "rb") as f:
            data_start, header = _read_header(f, file)
            entries = []
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                described = json.dumps([name, info.get("dtype"), info.get("shape")]).encode()
                entries.append((name, described + _sample(f, data_start, info)))
            return entries
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelLoadError(f"Cannot read the safetensors file {file}: {e}") from e


def _read_header(f: BinaryIO, file: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, parsed JSON header) of a safetensors file: an u64 length, then JSON."""
    (length,) = struct.unpack("<Q", f.read(8))
    if length > _MAX_HEADER_BYTES:
        raise ModelLoadError(f"{file} has a {length}-byte header: not a safetensors file")
    header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file} has no valid safetensors header")
    return 8 + length, header


def _sample(f: BinaryIO, data_start: int, info: dict[str, Any]) -> bytes:
    """SAMPLE_BYTES at the start, middle and end of one tensor's data."""
    begin, end = info["data_offsets"]
    size = end - begin
    offsets = sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)})
    parts = []
    for offset in offsets:
        f.seek(data_start + begin + offset)
        parts.append(f.read(min(SAMPLE_BYTES, size - offset)))
    return b"".join(parts)
