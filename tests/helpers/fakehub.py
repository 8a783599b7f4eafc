"""A tiny local HTTP server speaking the few Hub endpoints huggingface_hub uses to fetch a model.

Not a mock of huggingface_hub: the real client talks HTTP to it through ``HF_ENDPOINT``. It serves
``/api/models/{repo}[/revision/{rev}]`` (model info, with file sizes), ``/api/models/{repo}/tree/{rev}``
(the file list), and ``/{repo}/resolve/{rev}/{path}`` (HEAD and GET, with ``Range``) to download, and
``/api/repos/create``, ``/api/validate-yaml``, ``.../preupload/{rev}`` (every file "regular"),
``.../branch/{name}`` (a branch from the default branch's head; 409 when it exists) and
``.../commit/{rev}`` (ndjson, base64 contents; 404 for a branch that does not exist, as the Hub) to push.
It records every GET of file content (and the bytes served per file), every repo and branch created and
every commit, so tests can check what was downloaded and uploaded; ``refuse`` answers every write (create,
branch, preupload, commit) with that HTTP status (401, 403: a missing or read-only token), ``refuse_commits``
only the commits, ``refuse_repos`` the commits to the repos it names (403). ``delays``
slows whole-file GETs of files by name suffix (so a test can watch a download's folder or interrupt it),
and a file named in ``withheld`` answers 404 to HEAD and whole-file GET while range reads still work (a
shard that vanished between the headers being read and the file being fetched).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


def push_env(env: dict[str, str], url: str) -> dict[str, str]:
    """``env`` (an offline test environment) made to reach the fake Hub at ``url`` with a token, Xet off (the fake
    Hub speaks none)."""
    online = {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}
    online.update(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_TOKEN="hf_fake_token_for_the_local_server")
    return online


class _Server(ThreadingHTTPServer):
    """A request still being answered when its client (a test that stopped reading) went away raises in
    its own thread, possibly after the test: not printed into a later test's stderr. Other errors are."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class FakeHub:
    """Repos in memory: ``repos[repo_id] = {"refs": {name: commit}, "commits": {commit: {path: bytes}}}``."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, dict]] = {}
        self.downloads: list[str] = []  # "repo/path" per GET of file content (full or ranged)
        self.full_downloads: list[str] = []  # "repo/path" per GET of a whole file
        self.auth: set[str | None] = set()  # Authorization headers seen
        self.created: list[dict] = []  # create_repo calls
        self.commits: list[dict] = []  # commits pushed
        self.branches: list[dict] = []  # create_branch calls
        self.refuse: int | None = None  # an HTTP status answering every write, or None
        self.refuse_commits: int | None = None  # an HTTP status answering commits only, or None
        self.refuse_repos: set[str] = set()  # repos whose commits are answered 403
        self.served: dict[str, int] = {}  # "repo/path" -> bytes of content sent (full and ranged GETs)
        self.delays: dict[str, float] = {}  # file name suffix -> seconds to wait before answering a whole-file GET
        self.withheld: set[str] = set()  # "repo/path" answering 404 except to range reads
        self._lock = threading.Lock()
        self.url = ""
        self._server: ThreadingHTTPServer | None = None

    def add(self, repo_id: str, commit: str, files: dict[str, bytes | Path], refs: tuple[str, ...] = ("main",)) -> None:
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        repo["commits"][commit] = {k: (v if isinstance(v, bytes) else Path(v).read_bytes()) for k, v in files.items()}
        for r in refs:
            repo["refs"][r] = commit

    def _resolve(self, repo_id: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None
        commit = repo["refs"].get(rev, rev)
        files = repo["commits"].get(commit)
        return (commit, files) if files is not None else None

    def _count(self, key: str, nbytes: int, full: bool) -> None:
        with self._lock:
            self.downloads.append(key)
            if full:
                self.full_downloads.append(key)
            self.served[key] = self.served.get(key, 0) + nbytes

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
                      head: bool = False) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, obj: object, code: int = 200, headers: dict[str, str] | None = None) -> None:
                self._send(code, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

            def _not_found(self, kind: str, head: bool = False) -> None:
                self._send(404, json.dumps({"error": f"{kind} not found"}).encode(),
                           {"X-Error-Code": kind, "X-Error-Message": f"{kind} not found",
                            "Content-Type": "application/json"}, head=head)

            def do_HEAD(self) -> None:  # noqa: N802
                self._handle(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._handle(head=False)

            def do_POST(self) -> None:  # noqa: N802
                hub.auth.add(self.headers.get("Authorization"))
                path = unquote(urlparse(self.path).path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if hub.refuse is not None and path != "/api/validate-yaml":
                    return self._send(hub.refuse, json.dumps({"error": "refused by the fake Hub"}).encode(),
                                      {"Content-Type": "application/json",
                                       "X-Error-Message": f"refused by the fake Hub ({hub.refuse})"})
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo_id = f"{req['organization']}/{req['name']}"
                    # (newer huggingface_hub sends "visibility", older ones (0.x, early 1.x) "private": true)
                    private = req.get("visibility", "private" if req.get("private") else "public") == "private"
                    hub.created.append({"repo_id": repo_id, "private": private, "type": req.get("type")})
                    hub.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
                    return self._json({"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
                if path == "/api/validate-yaml":
                    return self._json({"errors": [], "warnings": []})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/preupload/([^/]+)$", path)
                if m:
                    files = json.loads(body)["files"]
                    return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                 for f in files]})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/branch/([^/]+)$", path)
                if m:
                    repo_id, branch = m.groups()
                    if repo_id not in hub.repos:
                        return self._not_found("RepoNotFound")
                    repo = hub.repos[repo_id]
                    if branch in repo["refs"]:
                        return self._json({"error": "branch exists"}, 409)
                    hub.branches.append({"repo_id": repo_id, "branch": branch})
                    head = repo["refs"].get("main")
                    if head is None:  # (the Hub's new repos have a first commit; so do the fake's)
                        head = repo["refs"]["main"] = hashlib.sha1(repo_id.encode()).hexdigest()
                        repo["commits"][head] = {}
                    repo["refs"][branch] = head
                    return self._json({})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/commit/([^/]+)$", path)
                if m:
                    repo_id, rev = m.groups()
                    if repo_id not in hub.repos:
                        return self._not_found("RepoNotFound")
                    repo = hub.repos[repo_id]
                    if rev != "main" and rev not in repo["refs"]:
                        return self._not_found("RevisionNotFound")
                    if hub.refuse_commits is not None or repo_id in hub.refuse_repos:
                        return self._send(hub.refuse_commits or 403, b'{"error": "commit refused by the fake Hub"}',
                                          {"Content-Type": "application/json"})
                    parent = repo["commits"].get(repo["refs"].get(rev, ""), {})
                    files = dict(parent)
                    header: dict = {}
                    for line in body.splitlines():
                        item = json.loads(line)
                        if item["key"] == "header":
                            header = item["value"]
                        elif item["key"] == "file":
                            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    commit = hashlib.sha1(body).hexdigest()
                    repo["commits"][commit] = files
                    repo["refs"][rev] = commit
                    hub.commits.append({"repo_id": repo_id, "summary": header.get("summary"), "commit": commit,
                                        "revision": rev})
                    return self._json({"commitUrl": f"{hub.url}/{repo_id}/commit/{commit}", "commitOid": commit,
                                       "pullRequestUrl": None})
                return self._not_found("Unknown")

            def _handle(self, head: bool) -> None:
                hub.auth.add(self.headers.get("Authorization"))
                path = unquote(urlparse(self.path).path)
                m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/(.+))?$", path)
                if m:
                    repo_id, rev = m.group(1), m.group(2) or "main"
                    if repo_id not in hub.repos:
                        return self._not_found("RepoNotFound")
                    got = hub._resolve(repo_id, rev)
                    if got is None:
                        return self._not_found("RevisionNotFound")
                    commit, files = got
                    sib = [{"rfilename": p, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
                           for p, b in sorted(files.items())]
                    return self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                       "siblings": sib, "tags": [], "downloads": 0, "likes": 0})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
                if m:
                    got = hub._resolve(m.group(1), m.group(2))
                    if got is None:
                        return self._not_found("RevisionNotFound")
                    _commit, files = got
                    return self._json([{"type": "file", "oid": hashlib.sha1(b).hexdigest(), "size": len(b),
                                        "path": p} for p, b in sorted(files.items())])
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if m:
                    repo_id, rev, fpath = m.groups()
                    if repo_id not in hub.repos:
                        return self._not_found("RepoNotFound", head)
                    got = hub._resolve(repo_id, rev)
                    if got is None:
                        return self._not_found("RevisionNotFound", head)
                    commit, files = got
                    if fpath not in files:
                        return self._not_found("EntryNotFound", head)
                    data = files[fpath]
                    key = f"{repo_id}/{fpath}"
                    rng = self.headers.get("Range")
                    if key in hub.withheld and not (rng and not head):
                        return self._not_found("EntryNotFound", head)
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                               "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                    if rng and not head:
                        a, _, b = rng.removeprefix("bytes=").partition("-")
                        start, stop = int(a), min(int(b) + 1 if b else len(data), len(data))
                        hub._count(key, len(data[start:stop]), full=False)
                        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
                        return self._send(206, data[start:stop], headers)
                    if not head:
                        time.sleep(sum(t for suffix, t in hub.delays.items() if fpath.endswith(suffix)))
                        hub._count(key, len(data), full=True)
                    return self._send(200, data, headers, head=head)
                return self._not_found("Unknown")

        self._server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
