"""Tests of tests/hub.py, the local Hugging Face Hub endpoint that download tests point `HF_ENDPOINT` at.

They drive the real `huggingface_hub` client against it. The client reads `HF_ENDPOINT` and `HF_HUB_OFFLINE` once,
at import, so in-process calls name the endpoint, cache folder and token explicitly; the environment variables are
set as well for anything started from a test (a subprocess reads them afresh).
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import HfApi, constants, file_download, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import ModelInfo, RepoFile, RepoFolder

from tests.hub import LocalHub

REPO = "org/tiny"
CONFIG = b'{"model_type": "llama", "hidden_size": 64}\n'
WEIGHTS = bytes(range(256)) * 32  # 8 KiB, served as an LFS file
FILES = {
    "config.json": CONFIG,
    "tokenizer.json": b'{"version": "1.0"}\n',
    "model.safetensors": WEIGHTS,
    "sub/extra.txt": b"nested\n",
}


def make_folder(root: Path, name: str, files: dict[str, bytes]) -> Path:
    folder = root / name
    for path, data in files.items():
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return folder


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalHub]:
    with LocalHub() as local_hub:
        monkeypatch.setenv("HF_ENDPOINT", local_hub.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        yield local_hub


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def commit(hub: LocalHub, tmp_path: Path) -> str:
    return hub.add_repo(REPO, make_folder(tmp_path, "v1", FILES))


def download(hub: LocalHub, cache: Path, filename: str, **kwargs: Any) -> Path:
    kwargs.setdefault("token", False)
    return Path(hf_hub_download(REPO, filename, endpoint=hub.endpoint, cache_dir=cache, **kwargs))


def test_download_gives_identical_bytes_under_the_commit_snapshot(hub: LocalHub, cache: Path, commit: str) -> None:
    path = download(hub, cache, "config.json")
    assert path == cache / "models--org--tiny" / "snapshots" / commit / "config.json"
    assert path.read_bytes() == CONFIG
    # a plain file is stored under its git blob id, an LFS one under its sha256 (the ETags the endpoint sends)
    assert path.resolve().name == git_blob_sha1(CONFIG)
    weights = download(hub, cache, "model.safetensors")
    assert weights.read_bytes() == WEIGHTS
    assert weights.resolve().name == hashlib.sha256(WEIGHTS).hexdigest()
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == commit

    config_head, config_get = (f for f in hub.fetched if f.path == "config.json")
    assert (config_head.method, config_head.status, config_head.sent, config_head.commit) == ("HEAD", 200, 0, commit)
    assert (config_get.method, config_get.status, config_get.range) == ("GET", 200, None)
    assert (config_get.served, config_get.sent) == ((0, len(CONFIG)), len(CONFIG))
    assert hub.downloads() == ["config.json", "model.safetensors"]


def test_snapshot_download_fetches_only_the_allowed_files(hub: LocalHub, cache: Path, commit: str) -> None:
    folder = Path(
        snapshot_download(REPO, allow_patterns=["*.json"], endpoint=hub.endpoint, cache_dir=cache, token=False)
    )
    assert folder == cache / "models--org--tiny" / "snapshots" / commit
    assert sorted(hub.downloads()) == ["config.json", "tokenizer.json"]
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "config.json",
        "tokenizer.json",
    ]
    assert (folder / "tokenizer.json").read_bytes() == FILES["tokenizer.json"]
    # the revision was resolved by the info route and the files listed by the tree route
    assert f"GET /api/models/{REPO}/revision/main" in hub.requests
    assert any(r.startswith(f"GET /api/models/{REPO}/tree/{commit}?recursive=") for r in hub.requests)

    hub.clear()
    snapshot_download(REPO, allow_patterns=["sub/*"], endpoint=hub.endpoint, cache_dir=cache, token=False)
    assert hub.downloads() == ["sub/extra.txt"]
    assert (folder / "sub" / "extra.txt").read_bytes() == b"nested\n"


def test_repo_info_reports_the_commit_and_files(hub: LocalHub, commit: str) -> None:
    api = HfApi(endpoint=hub.endpoint, token=False)
    info = api.repo_info(REPO)
    assert isinstance(info, ModelInfo)
    assert info.sha == commit
    assert info.id == REPO
    assert info.gated is False and info.private is False
    assert sorted(s.rfilename for s in info.siblings or []) == sorted(FILES)

    detailed = {s.rfilename: s for s in api.model_info(REPO, files_metadata=True).siblings or []}
    assert detailed["config.json"].size == len(CONFIG) and detailed["config.json"].lfs is None
    lfs = detailed["model.safetensors"].lfs
    assert lfs is not None and lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest() and lfs.size == len(WEIGHTS)


def test_tree_and_paths_info(hub: LocalHub, commit: str) -> None:
    api = HfApi(endpoint=hub.endpoint, token=False)
    top = {entry.path: entry for entry in api.list_repo_tree(REPO)}
    assert set(top) == {"config.json", "tokenizer.json", "model.safetensors", "sub"}
    assert isinstance(top["sub"], RepoFolder)
    config = top["config.json"]
    assert isinstance(config, RepoFile) and config.blob_id == git_blob_sha1(CONFIG) and config.lfs is None
    weights = top["model.safetensors"]
    assert isinstance(weights, RepoFile) and weights.size == len(WEIGHTS)
    assert weights.lfs is not None and weights.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()

    assert [e.path for e in api.list_repo_tree(REPO, path_in_repo="sub", revision=commit)] == ["sub/extra.txt"]
    everything = {e.path for e in api.list_repo_tree(REPO, recursive=True) if isinstance(e, RepoFile)}
    assert everything == set(FILES)

    info = api.get_paths_info(REPO, ["config.json", "sub", "absent.txt"])
    assert [(type(e).__name__, e.path) for e in info] == [("RepoFile", "config.json"), ("RepoFolder", "sub")]


def test_branches_tags_and_commits_resolve_to_their_own_files(
    hub: LocalHub, cache: Path, commit: str, tmp_path: Path
) -> None:
    second = hub.add_revision(REPO, make_folder(tmp_path, "v2", {**FILES, "config.json": b'{"v": 2}\n'}), "v2")
    branch = hub.add_revision(REPO, make_folder(tmp_path, "v3", {"config.json": b'{"v": 3}\n'}), "feature/x")
    assert len({commit, second, branch}) == 3

    api = HfApi(endpoint=hub.endpoint, token=False)
    assert api.repo_info(REPO, revision="main").sha == commit
    assert api.repo_info(REPO, revision="v2").sha == second
    assert api.repo_info(REPO, revision=second).sha == second
    assert api.repo_info(REPO, revision="feature/x").sha == branch  # sent percent-encoded

    assert download(hub, cache, "config.json").read_bytes() == CONFIG
    v2 = download(hub, cache, "config.json", revision="v2")
    assert v2.read_bytes() == b'{"v": 2}\n' and v2.parent.name == second
    assert download(hub, cache, "config.json", revision=second).read_bytes() == b'{"v": 2}\n'
    assert download(hub, cache, "config.json", revision="feature/x").read_bytes() == b'{"v": 3}\n'
    assert [f.revision for f in hub.fetched if f.method == "GET"] == ["main", "v2", "feature/x"]
    assert (cache / "models--org--tiny" / "refs" / "v2").read_text() == second


def test_unknown_repo(hub: LocalHub, cache: Path, commit: str) -> None:
    with pytest.raises(RepositoryNotFoundError) as raised:
        hf_hub_download("org/absent", "config.json", endpoint=hub.endpoint, cache_dir=cache, token=False)
    assert not isinstance(raised.value, GatedRepoError)
    assert raised.value.response.headers["X-Error-Code"] == "RepoNotFound"
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint, token=False).repo_info("org/absent")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/absent", endpoint=hub.endpoint, cache_dir=cache, token=False)


def test_unknown_revision(hub: LocalHub, cache: Path, commit: str) -> None:
    with pytest.raises(RevisionNotFoundError):
        download(hub, cache, "config.json", revision="nope")
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.endpoint, token=False).repo_info(REPO, revision="nope")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="nope", endpoint=hub.endpoint, cache_dir=cache, token=False)


def test_missing_file(hub: LocalHub, cache: Path, commit: str) -> None:
    with pytest.raises(RemoteEntryNotFoundError) as raised:
        download(hub, cache, "absent.txt")
    assert isinstance(raised.value, EntryNotFoundError)
    # the commit header of the 404 lets the client remember the absence
    assert (cache / "models--org--tiny" / ".no_exist" / commit / "absent.txt").exists()


def test_gated_repo_needs_its_token(hub: LocalHub, cache: Path, tmp_path: Path) -> None:
    hub.add_repo("org/gated", make_folder(tmp_path, "gated", {"config.json": CONFIG}), gated=True, token="hf_open")
    api = HfApi(endpoint=hub.endpoint, token=False)
    assert api.model_info("org/gated").gated == "auto"  # metadata stays public

    for token in (False, "hf_wrong"):
        with pytest.raises(GatedRepoError):
            hf_hub_download("org/gated", "config.json", endpoint=hub.endpoint, cache_dir=cache, token=token)
    assert [(f.method, f.status) for f in hub.fetched] == [("HEAD", 401), ("HEAD", 401)]

    path = hf_hub_download("org/gated", "config.json", endpoint=hub.endpoint, cache_dir=cache, token="hf_open")
    assert Path(path).read_bytes() == CONFIG


def test_interrupted_download_resumes_with_a_range(
    hub: LocalHub, cache: Path, commit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client only counts bytes it has been handed in whole chunks (10 MiB by default), and waits a second
    # before resuming: small chunks and no wait keep this test small and fast.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda _seconds: None))
    half = len(WEIGHTS) // 2
    hub.cut_next_download(REPO, "model.safetensors", after=half)

    path = download(hub, cache, "model.safetensors")
    assert path.read_bytes() == WEIGHTS
    cut, resumed = (f for f in hub.fetched if f.method == "GET")
    assert (cut.status, cut.range, cut.sent) == (200, None, half)
    assert (resumed.status, resumed.range, resumed.served, resumed.sent) == (
        206,
        f"bytes={half}-",
        (half, len(WEIGHTS)),
        len(WEIGHTS) - half,
    )
    assert not list((cache / "models--org--tiny" / "blobs").glob("*.incomplete"))


def test_a_partial_blob_left_by_an_earlier_run_is_not_resumed(hub: LocalHub, cache: Path, commit: str) -> None:
    # huggingface_hub 2.4 downloads into a fresh "<etag>.<random>.incomplete" file each time, so bytes left in a
    # "<etag>.incomplete" file (the name older versions resumed from) are ignored and the whole file is fetched.
    blobs = cache / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{hashlib.sha256(WEIGHTS).hexdigest()}.incomplete").write_bytes(WEIGHTS[: len(WEIGHTS) // 2])

    assert download(hub, cache, "model.safetensors").read_bytes() == WEIGHTS
    (get,) = (f for f in hub.fetched if f.method == "GET")
    assert (get.status, get.range, get.sent) == (200, None, len(WEIGHTS))


def http(hub: LocalHub, path: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(hub.endpoint + path, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, dict(error.headers.items()), error.read()


def test_resolve_headers_and_ranges(hub: LocalHub, commit: str) -> None:
    url = f"/{REPO}/resolve/main/model.safetensors"
    status, headers, body = http(hub, url, "HEAD")
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    assert (status, body) == (200, b"")
    assert headers["ETag"] == headers["X-Linked-Etag"] == f'"{sha256}"'
    assert headers["X-Linked-Size"] == headers["Content-Length"] == str(len(WEIGHTS))
    assert headers["X-Repo-Commit"] == commit and headers["Accept-Ranges"] == "bytes"
    assert not any(name.lower().startswith("x-xet") for name in headers)

    status, headers, body = http(hub, url, Range="bytes=100-199")
    assert (status, headers["Content-Range"], body) == (206, f"bytes 100-199/{len(WEIGHTS)}", WEIGHTS[100:200])
    status, _, body = http(hub, url, Range="bytes=8000-")
    assert (status, body) == (206, WEIGHTS[8000:])
    status, _, body = http(hub, url, Range="bytes=-10")
    assert (status, body) == (206, WEIGHTS[-10:])
    status, headers, _ = http(hub, url, Range=f"bytes={len(WEIGHTS)}-")
    assert (status, headers["Content-Range"]) == (416, f"bytes */{len(WEIGHTS)}")
    status, _, body = http(hub, url, Range="bytes=oops")
    assert (status, body) == (200, WEIGHTS)

    status, headers, _ = http(hub, f"/{REPO}/resolve/main/config.json", "HEAD")
    assert headers["ETag"] == f'"{git_blob_sha1(CONFIG)}"' and "X-Linked-Etag" not in headers
    assert [f.range for f in hub.fetched] == [
        None,
        "bytes=100-199",
        "bytes=8000-",
        "bytes=-10",
        f"bytes={len(WEIGHTS)}-",
        "bytes=oops",
        None,
    ]


def test_offline_reads_come_from_the_cache_without_any_request(
    hub: LocalHub, cache: Path, commit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = download(hub, cache, "config.json")
    snapshot = snapshot_download(REPO, allow_patterns=["*.json"], endpoint=hub.endpoint, cache_dir=cache, token=False)
    hub.clear()

    assert download(hub, cache, "config.json", local_files_only=True) == path
    local = snapshot_download(
        REPO, allow_patterns=["*.json"], endpoint=hub.endpoint, cache_dir=cache, local_files_only=True
    )
    assert local == snapshot
    with pytest.raises(LocalEntryNotFoundError):
        download(hub, cache, "model.safetensors", local_files_only=True)
    # HF_HUB_OFFLINE is read at import; the module constant can be switched in process instead
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert download(hub, cache, "config.json") == path
    assert hub.requests == []


def test_a_subprocess_finds_the_endpoint_and_cache_through_the_environment(hub: LocalHub, commit: str) -> None:
    # only HF_ENDPOINT and HF_HUB_CACHE (set by the fixture) tell the fresh interpreter where to go
    code = (
        "from huggingface_hub import hf_hub_download; print(hf_hub_download('org/tiny', 'config.json', token=False))"
    )
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    path = Path(printed.stdout.splitlines()[-1])
    assert path.read_bytes() == CONFIG and path.parent.name == commit
    assert hub.downloads() == ["config.json"]


def test_use_in_process_serves_code_that_names_no_endpoint(
    hub: LocalHub, cache: Path, commit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.use_in_process(monkeypatch, cache)
    path = Path(hf_hub_download(REPO, "config.json", token=False))
    assert path == cache / "models--org--tiny" / "snapshots" / commit / "config.json"
    assert HfApi(token=False).repo_info(REPO).sha == commit
    assert huggingface_hub.model_info(REPO, token=False).sha == commit
    assert hub.downloads() == ["config.json"]


def test_bad_requests_leave_the_endpoint_serving(hub: LocalHub, commit: str) -> None:
    status, headers, body = http(hub, "/no/such/route/at/all")
    assert (status, headers["X-Error-Code"], body) == (404, "RepoNotFound", b'{"error": "Repository not found"}')
    assert http(hub, f"/api/models/{REPO}", "DELETE")[0] == 404
    assert http(hub, f"/api/models/{REPO}/tree/main/absent")[1]["X-Error-Code"] == "EntryNotFound"
    assert http(hub, f"/api/models/{REPO}/revision/nope")[1]["X-Error-Code"] == "RevisionNotFound"
    request = urllib.request.Request(
        f"{hub.endpoint}/api/models/{REPO}/paths-info/main",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=5)
    with raised.value:
        assert raised.value.code == 400
    host, port = hub.endpoint.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"\x00\x01garbage that is not http\r\n\r\n")
        raw.recv(1024)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        raw.recv(1024)

    status, _, body = http(hub, f"/{REPO}/resolve/{commit}/config.json")
    assert (status, body) == (200, CONFIG)
