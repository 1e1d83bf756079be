"""A local stand-in for the Hugging Face Hub on 127.0.0.1 (standard library only), for tests.

It speaks the part of the Hub HTTP API that huggingface_hub (legacy LFS path, i.e. with
``HF_HUB_DISABLE_XET=1``) uses to push and pull a model repo:

    POST /api/repos/create                          create (409 if it exists)
    POST /api/validate-yaml                         model-card front matter (400 if not a YAML mapping)
    POST /api/models/NS/NAME/branch/BRANCH          create a branch from main
    POST /api/models/NS/NAME/preupload/REV          upload mode per file (lfs for *.safetensors) + remote oid
    POST /NS/NAME.git/info/lfs/objects/batch        LFS batch: an upload href per missing object
    PUT  /lfs/OID                                   the blob (sha256 checked)
    POST /api/models/NS/NAME/commit/REV             NDJSON commit: header, file, lfsFile, deletedFile
    GET  /api/models/NS/NAME[/revision/REV]         model info with siblings
    GET  /api/models/NS/NAME/tree/REV               file listing (oid, size, lfs)
    HEAD/GET /NS/NAME/resolve/REV/PATH              file, with X-Repo-Commit, ETag / X-Linked-Etag, sizes

The three reads also serve dataset repos (``/api/datasets/...``, ``/datasets/NS/NAME/resolve/...``)
that a test adds with ``add_dataset``.

State lives in memory; a commit is applied all at once or not at all. ``fail(route, status)``
injects errors (``route`` is one of the names in ``ROUTES``); ``token`` / ``read_only_token``
make writes answer 401 / 403.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_READ_REPO = r"(?P<repo>(?:datasets/)?[^/]+/[^/]+)"  # reads also serve dataset repos, keyed "datasets/NS/NAME"
ROUTES = [  # (name, method, path regex); the first match wins
    ("create", "POST", r"/api/repos/create"),
    ("yaml", "POST", r"/api/validate-yaml"),
    ("branch", "POST", rf"/api/models/{_REPO}/branch/(?P<rev>[^/]+)"),
    ("preupload", "POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)"),
    ("commit", "POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)"),
    ("lfs-batch", "POST", rf"/{_REPO}\.git/info/lfs/objects/batch"),
    ("lfs-put", "PUT", r"/lfs/(?P<oid>[0-9a-f]{64})"),
    ("tree", "GET", rf"/api/(?:models/|(?=datasets/)){_READ_REPO}/tree/(?P<rev>[^/]+)(?:/.*)?"),
    ("info", "GET", rf"/api/(?:models/|(?=datasets/)){_READ_REPO}(?:/revision/(?P<rev>[^/]+))?"),
    ("resolve", "HEAD", rf"/{_READ_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
    ("resolve", "GET", rf"/{_READ_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
]
WRITES = {"create", "branch", "preupload", "commit", "lfs-batch"}  # the PUT href is pre-authorised (like S3)


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: content}
    lfs_paths: dict[str, set[str]] = field(default_factory=dict)  # sha -> paths stored as LFS
    branches: dict[str, str] = field(default_factory=dict)  # branch -> sha

    def commit_for(self, rev: str) -> str | None:
        return self.branches.get(rev) or (rev if rev in self.commits else None)


class HubServer:
    """``with HubServer() as hub:`` serves on ``hub.url`` until the block ends."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 -> blob
        self.log: list[tuple[str, str, int]] = []  # (method, path, status)
        self.validated: list[str] = []  # model cards sent to /api/validate-yaml
        self.faults: dict[str, int] = {}
        self.token: str | None = None  # when set, writes need "Bearer <token>" (else 401)
        self.read_only_token: str | None = None  # accepted for reads; writes get 403
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_dataset(self, repo_id: str, files: dict[str, bytes]) -> str:
        """A dataset repo with ``files`` in one commit (read-only routes serve it); returns the sha."""
        with self.lock:
            repo = self.repos[f"datasets/{repo_id}"] = Repo(private=False)
            sha = repo.branches["main"] = self.new_commit(repo, None, files, set(), "add data")
        return sha

    def fail(self, route: str, status: int = 500) -> None:
        """Answer every request to ``route`` with ``status`` until :meth:`heal`."""
        self.faults[route] = status

    def heal(self) -> None:
        self.faults.clear()

    def calls(self, route: str) -> int:
        return sum(1 for method, path, _ in self.log if _route(method, path)[0] == route)

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[repo.commit_for(rev)]

    def num_commits(self, repo_id: str) -> int:
        return len(self.repos[repo_id].commits) - 1  # minus the initial .gitattributes commit

    # -- repository state (called with the lock held) ---------------------------------------------
    def new_commit(self, repo: Repo, parent: str | None, files: dict[str, bytes], lfs: set[str], summary: str) -> str:
        seed = json.dumps([parent, summary, sorted((p, git_oid(c)) for p, c in files.items()), len(repo.commits)])
        sha = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[sha], repo.lfs_paths[sha] = files, lfs
        return sha


def _route(method: str, path: str) -> tuple[str | None, dict]:
    for name, verb, pattern in ROUTES:
        match = re.fullmatch(pattern, path)
        if verb == method and match:
            return name, {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
    return None, {}


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        # -- plumbing ----------------------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, body: bytes | dict | list = b"", headers: dict | None = None) -> None:
            if isinstance(body, dict | list):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            hub.log.append((self.command, urlsplit(self.path).path, status))

        def _error(self, status: int, message: str, code: str | None = None, extra: dict | None = None) -> None:
            headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(extra or {})}
            self._send(status, {"error": message}, headers)

        def _dispatch(self) -> None:
            name, args = _route(self.command, urlsplit(self.path).path)
            body = self._body() if self.command in ("POST", "PUT") else b""
            if name is None:
                return self._error(404, f"no route for {self.command} {self.path}")
            if name in hub.faults:
                return self._error(hub.faults[name], f"injected failure of {name}")
            auth = self.headers.get("Authorization", "")
            if name in WRITES and hub.token and auth != f"Bearer {hub.token}":
                if hub.read_only_token and auth == f"Bearer {hub.read_only_token}":
                    return self._error(403, "You don't have the rights to write to this namespace")
                return self._error(401, "Invalid credentials in Authorization header")
            with hub.lock:
                getattr(self, "r_" + name.replace("-", "_"))(body, **args)

        do_GET = do_HEAD = do_POST = do_PUT = _dispatch

        def _repo(self, repo: str) -> Repo | None:
            if repo not in hub.repos:
                self._error(404, "Repository not found", "RepoNotFound")
            return hub.repos.get(repo)

        def _commit(self, repo: Repo, rev: str) -> str | None:
            sha = repo.commit_for(rev)
            if sha is None:
                self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            return sha

        # -- routes ------------------------------------------------------------------------------
        def r_create(self, body: bytes) -> None:
            payload = json.loads(body)
            repo_id = f"{payload['organization']}/{payload['name']}"
            if repo_id in hub.repos:  # huggingface_hub reads "url" from the 409 too (exist_ok=True)
                message = "You already created this model repo"
                return self._send(409, {"error": message, "url": f"{hub.url}/{repo_id}"}, {"X-Error-Message": message})
            repo = hub.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
            attributes = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
            repo.branches["main"] = hub.new_commit(repo, None, {".gitattributes": attributes}, set(), "initial commit")
            self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def r_yaml(self, body: bytes) -> None:
            content = json.loads(body)["content"]
            hub.validated.append(content)
            match = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
            try:
                meta = yaml.safe_load(match.group(1)) if match else None
            except yaml.YAMLError as exc:
                meta = str(exc)
            if not isinstance(meta, dict):
                return self._send(400, {"errors": [{"message": "metadata must be a YAML mapping"}]})
            self._send(200, {"errors": [], "warnings": []})

        def r_branch(self, body: bytes, repo: str, rev: str) -> None:
            if (r := self._repo(repo)) is None:
                return
            if rev in r.branches:
                return self._error(409, "Reference already exists")
            r.branches[rev] = r.branches["main"]
            self._send(200, {})

        def r_preupload(self, body: bytes, repo: str, rev: str) -> None:
            if (r := self._repo(repo)) is None:
                return
            sha = r.commit_for(rev) or r.branches["main"]
            files, lfs = r.commits[sha], r.lfs_paths[sha]
            out = []
            for f in json.loads(body)["files"]:
                mode = "lfs" if f["path"].endswith(".safetensors") or f["size"] > 10_000_000 else "regular"
                old = files.get(f["path"])
                oid = None if old is None else (hashlib.sha256(old).hexdigest() if f["path"] in lfs else git_oid(old))
                out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
            self._send(200, {"files": out, "commitOid": sha})

        def r_lfs_batch(self, body: bytes, repo: str) -> None:
            if self._repo(repo) is None:
                return
            objects = []
            for obj in json.loads(body)["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                if obj["oid"] not in hub.lfs:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs/{obj['oid']}"}}
                objects.append(entry)
            self._send(200, {"transfer": "basic", "objects": objects})

        def r_lfs_put(self, body: bytes, oid: str) -> None:
            if hashlib.sha256(body).hexdigest() != oid:
                return self._error(400, "sha256 of the upload does not match its oid")
            hub.lfs[oid] = body
            self._send(200)

        def r_commit(self, body: bytes, repo: str, rev: str) -> None:
            if (r := self._repo(repo)) is None or (parent := self._commit(r, rev)) is None:
                return
            files, lfs, summary = dict(r.commits[parent]), set(r.lfs_paths[parent]), ""
            for line in body.decode().splitlines():
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    summary = value["summary"]
                elif key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                    lfs.discard(value["path"])
                elif key == "lfsFile":
                    if value["oid"] not in hub.lfs:
                        return self._error(422, f"LFS object {value['oid']} was not uploaded")
                    files[value["path"]] = hub.lfs[value["oid"]]
                    lfs.add(value["path"])
                elif key == "deletedFile":
                    files.pop(value["path"], None)
                    lfs.discard(value["path"])
            sha = hub.new_commit(r, parent, files, lfs, summary)
            r.branches[rev if rev in r.branches else "main"] = sha
            self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha, "success": True,
                             "pullRequestUrl": None})

        def r_info(self, body: bytes, repo: str, rev: str = "main") -> None:
            if (r := self._repo(repo)) is None or (sha := self._commit(r, rev)) is None:
                return
            siblings = [{"rfilename": p} for p in sorted(r.commits[sha])]
            self._send(200, {"id": repo, "modelId": repo, "sha": sha, "private": r.private, "siblings": siblings,
                             "tags": [], "downloads": 0, "likes": 0})

        def r_tree(self, body: bytes, repo: str, rev: str) -> None:
            if (r := self._repo(repo)) is None or (sha := self._commit(r, rev)) is None:
                return
            entries = []
            for path, data in sorted(r.commits[sha].items()):
                entry = {"type": "file", "path": path, "size": len(data), "oid": git_oid(data)}
                if path in r.lfs_paths[sha]:
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            self._send(200, entries)

        def r_resolve(self, body: bytes, repo: str, rev: str, path: str) -> None:
            if (r := self._repo(repo)) is None or (sha := self._commit(r, rev)) is None:
                return
            data = r.commits[sha].get(path)
            if data is None:
                return self._error(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": sha})
            headers = {"X-Repo-Commit": sha, "ETag": f'"{git_oid(data)}"', "Content-Type": "application/octet-stream"}
            if path in r.lfs_paths[sha]:
                headers.update({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))})
            self._send(200, data, headers)

    return Handler
