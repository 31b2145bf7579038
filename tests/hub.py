"""A local Hugging Face Hub for tests: an HTTP endpoint that speaks enough of the Hub's protocol for the real
`huggingface_hub` client (model info, tree listings, paths-info, HEAD/GET on resolve with ranges, gated repos and
the Hub's error codes), so that downloads can be tested offline and every file request can be inspected.

Point the client at it with `endpoint=hub.endpoint` (or `HF_ENDPOINT` in a subprocess):

    with LocalHub() as hub:
        commit = hub.add_repo("org/tiny", folder)
        path = hf_hub_download("org/tiny", "config.json", endpoint=hub.endpoint, cache_dir=cache)
        assert hub.downloads() == ["config.json"]

Only model repos with ids of the form "org/name" are served. No Xet headers are ever sent, so the client always
downloads over plain HTTP from this endpoint.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    import pytest

# Files the Hub stores in LFS (the rest are plain git blobs); it reports their sha256 and real size.
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")
# A fixed date, so that info responses are reproducible.
LAST_MODIFIED = "2024-01-01T00:00:00.000Z"
# Request bodies are tiny (paths-info); anything larger is refused rather than read into memory.
MAX_BODY = 1 << 20


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class HubFile:
    """One file of one commit, held in memory (files are read when the revision is added)."""

    path: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def is_lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def lfs_pointer(self) -> bytes:
        """The git-lfs pointer file that git stores in place of an LFS file."""
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    @property
    def blob_id(self) -> str:
        """The git object id, as in tree listings: that of the pointer for LFS files, as on the Hub."""
        return _git_blob_sha1(self.lfs_pointer if self.is_lfs else self.data)

    @property
    def etag(self) -> str:
        """What the Hub's resolve sends as ETag: the sha256 for LFS files, the git blob sha1 otherwise."""
        return self.sha256 if self.is_lfs else _git_blob_sha1(self.data)

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": self.size, "path": self.path}
        if self.is_lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": len(self.lfs_pointer)}
        return entry


def read_folder(folder: Path) -> dict[str, HubFile]:
    """The files under `folder` by their repo path (posix, relative); a `.git` folder is not part of the repo."""
    files: dict[str, HubFile] = {}
    for item in sorted(Path(folder).rglob("*")):
        relative = item.relative_to(folder)
        if item.is_file() and ".git" not in relative.parts:
            files[relative.as_posix()] = HubFile(relative.as_posix(), item.read_bytes())
    return files


def commit_of(files: dict[str, HubFile]) -> str:
    """A deterministic 40-hex commit id of a set of files: the sha1 of the sorted names and contents."""
    digest = hashlib.sha1(usedforsecurity=False)
    for path in sorted(files):
        data = files[path].data
        digest.update(b"%s\0%d\0" % (path.encode(), len(data)))
        digest.update(data)
    return digest.hexdigest()


@dataclass
class HubRepo:
    """A model repo: named revisions (branches and tags alike) pointing at commits, and each commit's files.

    `folders` keeps where each commit's files were read from; `files` holds their contents as read then.
    A gated repo serves its files only to a request bearing `token` (any token when it is None), while its
    metadata (info, tree, paths-info) stays public, as on the Hub.
    """

    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)
    files: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    gated: bool = False
    token: str | None = None

    def resolve(self, revision: str) -> str | None:
        """The commit a branch, tag or full commit id names, or None."""
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.files else None

    def opens_with(self, authorization: str | None) -> bool:
        if not self.gated:
            return True
        if authorization is None or not authorization.startswith("Bearer "):
            return False
        given = authorization.removeprefix("Bearer ").strip()
        return bool(given) and (self.token is None or given == self.token)


@dataclass(frozen=True)
class Fetch:
    """One request on a resolve URL.

    `served` is the [start, end) byte span the response covered (None for HEAD and errors); `sent` is the number
    of body bytes written (fewer than the span when the download was cut on purpose). A request is recorded just
    before its answer is sent.
    """

    repo: str
    revision: str
    commit: str | None
    path: str
    method: str
    status: int
    range: str | None
    served: tuple[int, int] | None
    sent: int


@dataclass
class _Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    # the full file behind a resolve GET, and the span of it to send
    content: bytes | None = None
    span: tuple[int, int] | None = None
    # stop after this many body bytes and drop the connection (a simulated network failure)
    cut_after: int | None = None
    fetch: Fetch | None = None


def _json_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> _Reply:
    return _Reply(status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(payload).encode("utf-8"))


def _error(status: int, code: str | None, message: str, headers: dict[str, str] | None = None) -> _Reply:
    extra = dict(headers or {})
    if code is not None:
        extra["X-Error-Code"] = code
    extra["X-Error-Message"] = message
    return _json_reply(status, {"error": message}, extra)


def _repo_not_found() -> _Reply:
    return _error(404, "RepoNotFound", "Repository not found")


def _parse_range(header: str, size: int) -> tuple[int, int] | None | str:
    """The [start, end) span a `Range: bytes=...` header asks for; None to serve the whole file (a header we do not
    handle, e.g. several ranges, may be ignored); "unsatisfiable" for a 416."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if first == "":
            suffix = int(last)
            if suffix <= 0 or size == 0:
                return "unsatisfiable"
            return max(size - suffix, 0), size
        start = int(first)
        end = size if last == "" else min(int(last) + 1, size)
    except ValueError:
        return None
    if start < 0 or start >= size or end <= start:
        return "unsatisfiable"
    return start, end


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: LocalHub

    def __init__(self, hub: LocalHub) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Close kept-alive client connections, so that no handler thread outlives the server."""
        with self.connections_lock:
            connections = list(self.connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that went away is not an error of the endpoint; stay quiet
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # an idle kept-alive connection is closed after this long
    timeout = 30
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def _serve(self, method: str) -> None:
        started = False
        try:
            body = self._read_body()
            if body is None:
                reply = _error(413, None, "Request body too large")
                self.close_connection = True
            else:
                reply = self.server.hub._route(method, self.path, dict(self.headers.items()), body)
            started = True
            self._write(method, reply)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception:  # noqa: BLE001 - a bad request must never take the endpoint down
            self.close_connection = True
            if not started:
                try:
                    self._write(method, _error(500, None, "Internal error of the local hub"))
                except OSError:
                    pass

    def _read_body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            size = int(length)
        except ValueError:
            size = -1
        if size < 0 or size > MAX_BODY:
            return None
        return self.rfile.read(size)

    def _write(self, method: str, reply: _Reply) -> None:
        if reply.content is not None and reply.span is not None:
            start, end = reply.span
            payload = memoryview(reply.content)[start:end]
        else:
            payload = memoryview(reply.body)
        body = payload if method != "HEAD" else payload[:0]
        if reply.cut_after is not None:
            body = body[: reply.cut_after]
            self.close_connection = True
        if reply.fetch is not None:
            # recorded before anything is sent, so that a client that has its answer always finds it recorded
            self.server.hub._record(replace(reply.fetch, sent=len(body)))
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(body)
            self.wfile.flush()


class LocalHub:
    """A Hub-compatible endpoint on 127.0.0.1 (a free port), served from a daemon thread until `stop()`.

    `fetched` lists every request on a resolve URL (HEAD and GET, with what was served); `requests` lists every
    request of any kind as "METHOD /path?query". Both are snapshots, safe to read while the server runs.
    """

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self._lock = threading.Lock()
        self._fetched: list[Fetch] = []
        self._requests: list[str] = []
        self._cuts: dict[tuple[str, str], int] = {}
        self._stopped = False
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="local-hub", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> LocalHub:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.drop_connections()
        self._server.server_close()
        self._thread.join(timeout=5)

    def use_in_process(self, monkeypatch: pytest.MonkeyPatch, cache_dir: Path | str) -> None:
        """Point this process's huggingface_hub at this endpoint and `cache_dir`, for code that passes neither.

        The client reads HF_ENDPOINT and HF_HUB_CACHE once, at import, into several module constants (the resolve URL
        template among them, and the endpoint of the module-level `HfApi` behind `huggingface_hub.model_info` and
        friends), so setting the variables afterwards changes nothing in process; they are set too, for subprocesses.
        """
        from huggingface_hub import constants, hf_api

        monkeypatch.setenv("HF_ENDPOINT", self.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
        monkeypatch.setattr(constants, "ENDPOINT", self.endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
        monkeypatch.setattr(hf_api.api, "endpoint", self.endpoint)

    # ---- repos

    def add_repo(
        self, repo_id: str, folder: Path | str, *, gated: bool = False, token: str | None = None, branch: str = "main"
    ) -> str:
        """Serve the files under `folder` as repo `repo_id` ("org/name") at `branch`; return the commit id."""
        org, slash, name = repo_id.partition("/")
        if not (org and slash and name) or "/" in name:
            raise ValueError(f"repo ids are 'org/name', not {repo_id!r}")
        with self._lock:
            if repo_id in self.repos:
                raise ValueError(f"repo {repo_id} already exists")
            self.repos[repo_id] = HubRepo(repo_id, gated=gated, token=token)
        return self.add_revision(repo_id, folder, branch)

    def add_revision(self, repo_id: str, folder: Path | str, name: str | None) -> str:
        """Add the files under `folder` as a commit of `repo_id`, named `name` (a branch or tag; an existing name is
        moved to it, as a push to a branch does; None: reachable by its commit id only). Return the commit id."""
        files = read_folder(Path(folder))
        commit = commit_of(files)
        with self._lock:
            repo = self.repos.get(repo_id)
            if repo is None:
                raise KeyError(f"unknown repo {repo_id}")
            repo.files[commit] = files
            repo.folders[commit] = Path(folder)
            if name is not None:
                repo.refs[name] = commit
        return commit

    def cut_next_download(self, repo_id: str, path: str, after: int) -> None:
        """Make the next GET of `path` in `repo_id` (any revision) send only `after` bytes of its body and then drop
        the connection, as a failing network would; the client then sees a truncated response."""
        with self._lock:
            self._cuts[(repo_id, path)] = after

    # ---- what was requested

    @property
    def fetched(self) -> list[Fetch]:
        with self._lock:
            return list(self._fetched)

    @property
    def requests(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """The paths whose content was served by a successful GET, in order (a path may appear twice)."""
        return [
            f.path
            for f in self.fetched
            if f.method == "GET" and f.status in (200, 206) and (repo_id is None or f.repo == repo_id)
        ]

    def clear(self) -> None:
        with self._lock:
            self._fetched.clear()
            self._requests.clear()

    def _record(self, fetch: Fetch) -> None:
        with self._lock:
            self._fetched.append(fetch)

    # ---- routing

    def _route(self, method: str, target: str, headers: dict[str, str], body: bytes) -> _Reply:
        with self._lock:
            self._requests.append(f"{method} {target}")
        url = urlsplit(target)
        query = parse_qs(url.query)
        # split before unquoting, so that an encoded "/" (as in a revision "refs%2Fpr%2F1") stays in its segment
        parts = [unquote(part) for part in url.path.split("/")[1:]]
        if parts and parts[-1] == "":
            parts.pop()
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo = self._repo("/".join(parts[2:4]))
            if repo is None:
                return _repo_not_found()
            rest = parts[4:]
            if method == "GET" and not rest:
                return self._info(repo, "main", query)
            if method == "GET" and len(rest) >= 2 and rest[0] == "revision":
                return self._info(repo, "/".join(rest[1:]), query)
            if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                revision, path = self._split_revision(repo, rest[1:])
                return self._tree(repo, revision, path, query)
            if method == "POST" and len(rest) >= 2 and rest[0] == "paths-info":
                revision, _ = self._split_revision(repo, rest[1:])
                return self._paths_info(repo, revision, headers, body)
            return _repo_not_found()
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            repo = self._repo("/".join(parts[:2]))
            if repo is None:
                return _repo_not_found()
            revision, path = self._split_revision(repo, parts[3:])
            return self._resolve(method, repo, revision, path, headers)
        return _repo_not_found()

    def _repo(self, repo_id: str) -> HubRepo | None:
        with self._lock:
            return self.repos.get(repo_id)

    def _split_revision(self, repo: HubRepo, parts: list[str]) -> tuple[str, str]:
        """Split "rev/path..." where the client did not encode a "/" inside the revision: the shortest prefix naming
        a known revision wins; failing that, the first segment is taken as the (unknown) revision."""
        with self._lock:
            for count in range(1, len(parts) + 1):
                candidate = "/".join(parts[:count])
                if repo.resolve(candidate) is not None:
                    return candidate, "/".join(parts[count:])
        return parts[0], "/".join(parts[1:])

    def _commit_files(self, repo: HubRepo, revision: str) -> tuple[str, dict[str, HubFile]] | None:
        with self._lock:
            commit = repo.resolve(revision)
            if commit is None:
                return None
            return commit, repo.files[commit]

    def _info(self, repo: HubRepo, revision: str, query: dict[str, list[str]]) -> _Reply:
        found = self._commit_files(repo, revision)
        if found is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        commit, files = found
        with_blobs = query.get("blobs", ["false"])[-1].lower() in ("1", "true")
        siblings: list[dict[str, Any]] = []
        for path in sorted(files):
            sibling: dict[str, Any] = {"rfilename": path}
            if with_blobs:
                hub_file = files[path]
                sibling["size"] = hub_file.size
                sibling["blobId"] = hub_file.blob_id
                if hub_file.is_lfs:
                    sibling["lfs"] = {
                        "sha256": hub_file.sha256,
                        "size": hub_file.size,
                        "pointerSize": len(hub_file.lfs_pointer),
                    }
            siblings.append(sibling)
        info = {
            "_id": commit[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit,
            "lastModified": LAST_MODIFIED,
            "createdAt": LAST_MODIFIED,
            "private": False,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        return _json_reply(200, info)

    @staticmethod
    def _folder_entry(files: dict[str, HubFile], folder: str) -> dict[str, Any]:
        # a stable id for the folder, derived from what it holds (not git's tree hash, which nothing here needs)
        digest = hashlib.sha1(folder.encode(), usedforsecurity=False)
        for path in sorted(files):
            if path.startswith(folder + "/"):
                digest.update(f"{path}\0{files[path].blob_id}\0".encode())
        return {"type": "directory", "oid": digest.hexdigest(), "size": 0, "path": folder}

    @staticmethod
    def _folders(files: dict[str, HubFile]) -> set[str]:
        folders: set[str] = set()
        for path in files:
            pieces = path.split("/")[:-1]
            for depth in range(1, len(pieces) + 1):
                folders.add("/".join(pieces[:depth]))
        return folders

    def _tree(self, repo: HubRepo, revision: str, path: str, query: dict[str, list[str]]) -> _Reply:
        found = self._commit_files(repo, revision)
        if found is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        _, files = found
        folders = self._folders(files)
        path = path.strip("/")
        if path and path not in folders:
            return _error(404, "EntryNotFound", f"{path} does not exist on {revision!r} or is not a folder")
        recursive = query.get("recursive", ["false"])[-1].lower() in ("1", "true")
        prefix = f"{path}/" if path else ""

        def listed(item: str) -> bool:
            if not item.startswith(prefix):
                return False
            return recursive or "/" not in item[len(prefix) :]

        entries = [self._folder_entry(files, folder) for folder in sorted(folders) if listed(folder)]
        entries += [files[item].tree_entry() for item in sorted(files) if listed(item)]
        # everything fits in one page: without a Link header the client asks for no other page
        return _json_reply(200, entries)

    def _paths_info(self, repo: HubRepo, revision: str, headers: dict[str, str], body: bytes) -> _Reply:
        found = self._commit_files(repo, revision)
        if found is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        _, files = found
        content_type = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
        try:
            if "json" in content_type:
                paths = json.loads(body or b"{}").get("paths", [])
            else:
                paths = parse_qs(body.decode("utf-8")).get("paths", [])
        except (ValueError, AttributeError):
            return _error(400, None, "Invalid paths-info request body")
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            return _error(400, None, "paths must be a list of strings")
        folders = self._folders(files)
        entries: list[dict[str, Any]] = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                entries.append(files[path].tree_entry())
            elif path in folders:
                entries.append(self._folder_entry(files, path))
            # unknown paths are left out, as on the Hub
        return _json_reply(200, entries)

    def _resolve(self, method: str, repo: HubRepo, revision: str, path: str, headers: dict[str, str]) -> _Reply:
        lowered = {k.lower(): v for k, v in headers.items()}
        requested_range = lowered.get("range")

        def fetch(status: int, commit: str | None, served: tuple[int, int] | None = None) -> Fetch:
            return Fetch(repo.repo_id, revision, commit, path, method, status, requested_range, served, 0)

        if not repo.opens_with(lowered.get("authorization")):
            reply = _error(
                401,
                "GatedRepo",
                f"Access to model {repo.repo_id} is restricted. You must have access to it and be authenticated"
                " to access it. Please log in.",
            )
            reply.fetch = fetch(401, None)
            return reply
        found = self._commit_files(repo, revision)
        if found is None:
            reply = _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            reply.fetch = fetch(404, None)
            return reply
        commit, files = found
        hub_file = files.get(path)
        if hub_file is None:
            # the commit header lets the client remember that the file does not exist at this commit
            reply = _error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
            reply.fetch = fetch(404, commit)
            return reply
        reply_headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{hub_file.etag}"',
            "X-Repo-Commit": commit,
        }
        if hub_file.is_lfs:
            reply_headers["X-Linked-Etag"] = f'"{hub_file.sha256}"'
            reply_headers["X-Linked-Size"] = str(hub_file.size)
        status, span = 200, (0, hub_file.size)
        if requested_range is not None and method == "GET":
            parsed = _parse_range(requested_range, hub_file.size)
            if parsed == "unsatisfiable":
                reply = _error(
                    416, None, "Requested range not satisfiable", {"Content-Range": f"bytes */{hub_file.size}"}
                )
                reply.fetch = fetch(416, commit)
                return reply
            if isinstance(parsed, tuple):
                status, span = 206, parsed
                reply_headers["Content-Range"] = f"bytes {span[0]}-{span[1] - 1}/{hub_file.size}"
        cut_after = None
        if method == "GET":
            with self._lock:
                cut_after = self._cuts.pop((repo.repo_id, path), None)
        return _Reply(
            status,
            reply_headers,
            content=hub_file.data,
            span=span,
            cut_after=cut_after,
            fetch=fetch(status, commit, span if method == "GET" else None),
        )
