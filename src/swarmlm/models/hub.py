"""Models named by their Hugging Face Hub repository ("org/name"): each process downloads what it reads, no more.

A repository resolves to its snapshot folder in the Hub cache (HF_HUB_CACHE, shared with transformers), holding at
first only the small files: config, tokenizer, generation config and the safetensors index. The weight shards come
later, when `loading.load_tensors` asks for tensors: only the shards that hold them are fetched (`fetch_files`), so
a server of blocks 0:8 downloads the shards of those blocks, and a client those of the embeddings and the LM head.

The Hub's own conventions hold: HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_TOKEN for gated repositories,
HF_HUB_OFFLINE (and a Hub that cannot be reached) reading the cache alone, and a revision (a branch, tag or commit)
resolved to the commit that names the snapshot folder. huggingface_hub resumes an interrupted download and shows a
progress bar per file (its name, bytes and rate).

A .gguf file in a repository is named as llama.cpp users name it, the repository and the file:
"org/name/model.Q4_K_M.gguf", or "org/name:Q4_K_M" for the one file whose name holds that quantization.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swarmlm.errors import ModelLoadError

logger = logging.getLogger(__name__)

# "org/name": the Hub's repository ids (letters, digits, '-', '_', '.'; no '--' or '..' inside a name)
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:/(?P<file>[^/]+\.gguf)|:(?P<quant>[A-Za-z0-9_]+))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# a Hub cache's folder of one model repository ("models--org--name"), and the snapshot folders inside it
_REPO_FOLDER_PREFIX = "models--"
# the files every process reads: config, tokenizer and its chat template, generation config, the weights' index;
# never weights
SMALL_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja")
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHT_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class HubName:
    """A model named by its repository: `repo` ("org/name"), and a .gguf file in it, by name or by quantization."""

    repo: str
    gguf_file: str | None = None
    gguf_quant: str | None = None


def parse_hub_name(text: str) -> HubName | None:
    """The repository `text` names, or None when it is not a repository id (a caller checks local paths first)."""
    if text.startswith((".", "/", "~")) or "\\" in text or "--" in text or ".." in text:
        return None
    match = REPO_ID.match(text)
    if match is None:
        return None
    return HubName(match["repo"], match["file"], match["quant"])


def hub_origin(folder: Path) -> tuple[str, str] | None:
    """(repository id, commit) of a snapshot folder of a Hub cache; None for any other folder."""
    folder = Path(folder)
    repo_folder = folder.parent.parent
    if folder.parent.name != "snapshots" or not repo_folder.name.startswith(_REPO_FOLDER_PREFIX):
        return None
    parts = repo_folder.name[len(_REPO_FOLDER_PREFIX) :].split("--")
    if len(parts) != 2 or not COMMIT.match(folder.name):
        return None
    return f"{parts[0]}/{parts[1]}", folder.name


def resolve_hub(name: HubName, revision: str | None = None) -> Path:
    """The snapshot folder of `name` at `revision` (default: the repository's default branch), with its small files;
    or, for a .gguf file in the repository, that file. Raises ModelLoadError with one line saying what to do."""
    if name.gguf_file is not None or name.gguf_quant is not None:
        return _fetch_gguf(name, revision)
    folder = _snapshot(name.repo, revision, SMALL_FILES)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(_not_a_model(name.repo, folder, revision))
    if not (folder / INDEX_FILE).is_file():
        # a checkpoint in one file has no index saying where its tensors are: every process needs the file
        folder = _snapshot(name.repo, revision, (WEIGHTS_FILE,))
        if not (folder / WEIGHTS_FILE).is_file():
            raise ModelLoadError(_not_a_model(name.repo, folder, revision))
    return folder


def fetch_files(folder: Path, files: Iterable[str]) -> None:
    """Downloads the files of a Hub snapshot `folder` that are not there yet, one progress bar each, and marks them
    all as used now (for `evict`). A no-op for other folders."""
    origin = hub_origin(folder)
    if origin is None:
        return
    repo, commit = origin
    wanted = sorted(set(files))
    missing = [file for file in wanted if not (folder / file).is_file()]
    if missing:
        from huggingface_hub import hf_hub_download

        logger.info("Downloading %d of the %d weight files of %s this process reads", len(missing), len(wanted), repo)
        with _hub_errors(repo, commit):
            for file in missing:
                # by commit: a branch moved meanwhile never mixes two checkpoints in one folder
                hf_hub_download(repo, file, revision=commit, cache_dir=folder.parent.parent.parent)
    now = time.time()
    for file in wanted:
        try:
            # the blob's times say when a process last read it: least recently used is evicted first
            os.utime((folder / file).resolve(), (now, now))
        except OSError as e:
            logger.debug("Cannot mark %s as used: %s", file, e)


def evict(folder: Path, keep: Iterable[str], max_bytes: int) -> list[str]:
    """Deletes cached weight files of the repository of the snapshot `folder` (any of its snapshots) that are not in
    `keep` (files of `folder`), least recently used first, until the repository's cache holds at most `max_bytes`;
    returns the files deleted. The files in `keep` are never deleted, even when they alone exceed the budget."""
    if hub_origin(folder) is None:
        return []
    repo_folder = folder.parent.parent
    kept_blobs = {(folder / name).resolve() for name in keep}
    # every weight blob, with the snapshot links to it: a blob backs the same file in every snapshot holding it
    links: dict[Path, list[Path]] = {}
    for snapshot in (repo_folder / "snapshots").iterdir():
        for link in snapshot.iterdir():
            if link.name.endswith(WEIGHT_SUFFIX) and link.exists():
                links.setdefault(link.resolve(), []).append(link)
    size = sum(blob.stat().st_size for blob in (repo_folder / "blobs").iterdir() if blob.is_file())
    candidates = sorted((blob.stat().st_mtime, blob) for blob in links if blob not in kept_blobs)
    deleted: list[str] = []
    for _, blob in candidates:
        if size <= max_bytes:
            break
        freed = blob.stat().st_size
        for link in links[blob]:
            link.unlink(missing_ok=True)
        # a process that still maps the file keeps reading it: Linux frees the blocks once the last map goes
        blob.unlink(missing_ok=True)
        size -= freed
        deleted.extend(link.name for link in links[blob])
    if size > max_bytes:
        logger.warning("The cache of %s holds %.2f GB, over the disk budget of %.2f GB: the files of the served "
                       "blocks alone are that large", repo_folder.name, size / 1e9, max_bytes / 1e9)  # fmt: skip
    return deleted


def hub_cache_bytes(folder: Path) -> int:
    """Bytes the Hub cache holds for the repository of the snapshot `folder` (0 for other folders)."""
    if hub_origin(folder) is None:
        return 0
    blobs = folder.parent.parent / "blobs"
    return sum(blob.stat().st_size for blob in blobs.iterdir() if blob.is_file()) if blobs.is_dir() else 0


def _snapshot(repo: str, revision: str | None, patterns: Iterable[str]) -> Path:
    """huggingface_hub's snapshot_download of the files matching `patterns`, its errors told in one line."""
    from huggingface_hub import snapshot_download

    with _hub_errors(repo, revision):
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(patterns)))


def _fetch_gguf(name: HubName, revision: str | None) -> Path:
    from huggingface_hub import HfApi, hf_hub_download

    file = name.gguf_file
    with _hub_errors(name.repo, revision):
        if file is None:
            files = [f for f in HfApi().list_repo_files(name.repo, revision=revision) if f.lower().endswith(".gguf")]
            quant = str(name.gguf_quant).lower()
            matching = [f for f in files if re.search(rf"[.\-_]{re.escape(quant)}\.gguf$", f.lower())]
            if len(matching) != 1:
                listed = ", ".join(files) or "none"
                raise ModelLoadError(
                    f"The model {name.repo} has {len(matching)} .gguf files of quantization {name.gguf_quant} (its "
                    f".gguf files: {listed}); name one as {name.repo}/FILE.gguf."
                )
            file = matching[0]
        return Path(hf_hub_download(name.repo, file, revision=revision))


@contextmanager
def _hub_errors(repo: str, revision: str | None) -> Iterator[None]:
    """Turns huggingface_hub's errors into a ModelLoadError of one line that says what to do."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as error:
        message = _hub_error_message(repo, revision, error)
        if message is None:
            raise
        raise ModelLoadError(message) from error


def _hub_error_message(repo: str, revision: str | None, error: Exception) -> str | None:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    if isinstance(error, GatedRepoError):
        token = "the token in HF_TOKEN has no access" if os.environ.get("HF_TOKEN") else "no token is set"
        return (
            f"The model {repo} is gated and {token}: accept its licence on {endpoint}/{repo} and set HF_TOKEN to "
            "a token of that account (or log in with `hf auth login`)."
        )
    if isinstance(error, RevisionNotFoundError):
        return f"The model {repo} has no revision {revision!r} on {endpoint}: name a branch, a tag or a commit it has."
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"No model {repo!r} on {endpoint}: check the name (ORG/NAME), or set HF_TOKEN if the repository is "
            "private."
        )
    if isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        where = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{endpoint} cannot be reached"
        at = f" at revision {revision!r}" if revision else ""
        return (
            f"The model {repo}{at} is not (wholly) in the Hub cache ({constants.HF_HUB_CACHE}) and {where}: download "
            "it once while online (any swarmlm command or transformers does), then it runs offline."
        )
    if isinstance(error, EntryNotFoundError):
        return f"The model {repo} on {endpoint} lacks a file it names: {_first_line(error)}"
    if isinstance(error, HfHubHTTPError):
        return f"The Hub at {endpoint} refused the model {repo}: {_first_line(error)}"
    if isinstance(error, OSError):
        return f"Cannot download the model {repo} from {endpoint}: {_first_line(error)}"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _not_a_model(repo: str, folder: Path, revision: str | None) -> str:
    """Why the snapshot of `repo` is no model this project serves, as far as its files tell."""
    files = _repo_files(repo, revision)
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if ggufs:
        return (
            f"The model {repo} has no safetensors weights but .gguf files: name one as {repo}/{ggufs[0]} (or "
            f"{repo}:QUANT, e.g. {repo}:Q4_K_M)."
        )
    if not (folder / "config.json").is_file():
        return f"The repository {repo} has no config.json, so it is no Hugging Face model."
    if any(f.endswith((".bin", ".pt", ".pth")) for f in files):
        return (
            f"The model {repo} has only PyTorch pickle weights (.bin), which are not supported: use a repository "
            "with safetensors weights."
        )
    return f"The model {repo} has no safetensors weights ({WEIGHTS_FILE} or {INDEX_FILE})."


def _repo_files(repo: str, revision: str | None) -> list[str]:
    """The repository's file names, or [] when the Hub cannot tell (offline)."""
    from huggingface_hub import HfApi

    try:
        return list(HfApi().list_repo_files(repo, revision=revision))
    except Exception:  # noqa: BLE001 - only a better error message is lost
        return []


def model_type_of(folder: Path) -> str | None:
    """The model_type config.json names (None if it names none), read without transformers."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Cannot read {folder / 'config.json'}: {e}") from e
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None
