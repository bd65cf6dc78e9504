"""A loopback Hugging Face Hub for tests: the HTTP endpoints huggingface_hub 2.4 uses for `create_repo`,
`upload_folder` (preupload + ndjson commit, regular uploads only) and `snapshot_download` (repo info, tree listing,
resolve HEAD/GET), plus pull requests. Every request is recorded (method, path, whether it carried a token).

    with LoopbackHub() as hub:
        HfApi(endpoint=hub.url, token="hf_test").create_repo("me/x")
        assert hub.requests

Files are always answered "regular" by preupload, so no LFS/Xet transfer (which needs other servers) is attempted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    branches: dict[str, list[dict]] = field(default_factory=dict)  # name -> commits (oldest first)
    prs: int = 0

    def head(self, rev: str) -> dict | None:
        if rev in self.branches:
            return self.branches[rev][-1]
        return next((c for commits in self.branches.values() for c in commits if c["oid"] == rev), None)


class LoopbackHub:
    """Threaded HTTP server on 127.0.0.1 (random port) holding repos in memory."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            state = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> LoopbackHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def commit(self, repo: Repo, branch: str, message: str, files: dict[str, bytes], deleted=()) -> dict:
        parent = repo.branches[branch][-1]
        tree = {k: v for k, v in parent["files"].items() if k not in deleted} | files
        oid = hashlib.sha1(f"{parent['oid']}{message}{sorted(files)}{len(repo.branches[branch])}".encode()).hexdigest()
        commit = {"oid": oid, "message": message, "files": tree}
        repo.branches[branch].append(commit)
        return commit


class _Handler(BaseHTTPRequestHandler):
    state: LoopbackHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    # ---- plumbing
    def _record(self) -> tuple[list[str], dict]:
        """Record the request; return its path segments (each unquoted: a revision may be refs%2Fpr%2F1)."""
        url = urlsplit(self.path)
        with self.state.lock:
            self.state.requests.append({"method": self.command, "path": unquote(url.path),
                                        "auth": "Authorization" in self.headers})
        return [unquote(p) for p in url.path.split("/")], parse_qs(url.query)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None,
              head: bool = False) -> None:
        data = raw if raw is not None else json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if raw is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _not_found(self, what: str, code: str = "RepoNotFound", head: bool = False) -> None:
        self._send(404, {"error": f"{what} not found"}, {"X-Error-Code": code, "X-Error-Message": f"{what} not found"},
                   head=head)

    def _repo(self, repo_id: str) -> Repo | None:
        return self.state.repos.get(repo_id)

    # ---- verbs
    def do_POST(self) -> None:  # noqa: N802
        parts, query = self._record()  # ['', 'api', 'models', org, name, action, rev]
        body = self._body()
        if parts[1:] == ["api", "repos", "create"]:
            return self._create(json.loads(body))
        if parts[1:] == ["api", "validate-yaml"]:
            return self._send(200, {"errors": [], "warnings": []})
        if len(parts) >= 6 and parts[1:3] == ["api", "models"]:
            repo_id, action, rest = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:])
            repo = self._repo(repo_id)
            if repo is None:
                return self._not_found(f"Repository {repo_id}")
            if action == "preupload":
                return self._preupload(repo, rest, json.loads(body))
            if action == "commit":
                return self._commit(repo, repo_id, rest, body, "create_pr" in query)
            if action == "discussions":
                return self._new_pr(repo)
        self._send(404, {"error": f"no route POST {'/'.join(parts)}"})

    def do_GET(self) -> None:  # noqa: N802
        self._get(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._get(head=True)

    def _get(self, head: bool) -> None:
        parts, _ = self._record()
        if len(parts) >= 5 and parts[1:3] == ["api", "models"]:
            repo_id, repo = f"{parts[3]}/{parts[4]}", self._repo(f"{parts[3]}/{parts[4]}")
            if repo is None:
                return self._not_found(f"Repository {repo_id}", head=head)
            action = parts[5] if len(parts) > 5 else "revision"
            rev = parts[6] if len(parts) > 6 else "main"
            if action == "discussions":
                return self._pr_details(repo_id, int(parts[6]))
            commit = repo.head(rev)
            if commit is None:
                return self._not_found(f"Revision {rev}", "RevisionNotFound", head)
            if action == "revision":
                siblings = [{"rfilename": p} for p in sorted(commit["files"])]
                return self._send(200, {"id": repo_id, "modelId": repo_id, "sha": commit["oid"],
                                        "private": repo.private, "siblings": siblings}, head=head)
            if action == "tree":
                return self._send(200, [{"type": "file", "path": p, "size": len(d), "oid": git_blob_sha(d)}
                                        for p, d in sorted(commit["files"].items())], head=head)
        if len(parts) >= 6 and parts[3] == "resolve":
            return self._resolve(f"{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:]), head)
        self._send(404, {"error": f"no route GET {'/'.join(parts)}"}, head=head)

    # ---- endpoints
    def _create(self, payload: dict) -> None:
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        url = f"{self.state.url}/{repo_id}"
        with self.state.lock:
            if repo_id in self.state.repos:
                return self._send(409, {"error": "You already created this model repo", "url": url})
            repo = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
            repo.branches["main"] = [{"oid": hashlib.sha1(repo_id.encode()).hexdigest(), "message": "initial commit",
                                      "files": {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs\n"}}]
            self.state.repos[repo_id] = repo
        self._send(200, {"url": url})

    def _preupload(self, repo: Repo, rev: str, payload: dict) -> None:
        files = (repo.head(rev) or repo.branches["main"][-1])["files"]
        self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                    "oid": git_blob_sha(files[f["path"]]) if f["path"] in files else None}
                                   for f in payload["files"]]})

    def _commit(self, repo: Repo, repo_id: str, rev: str, body: bytes, create_pr: bool) -> None:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        files, deleted = {}, []
        for item in lines:
            if item["key"] == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] == "deletedFile":
                deleted.append(item["value"]["path"])
            elif item["key"] != "header":
                return self._send(400, {"error": f"loopback hub: unsupported commit operation {item['key']}"})
        branch = rev
        pr_url = None
        with self.state.lock:
            if create_pr:
                branch, pr_url = self._open_pr(repo, repo_id)
            if branch not in repo.branches:
                return self._not_found(f"Revision {branch}", "RevisionNotFound")
            commit = self.state.commit(repo, branch, header["summary"], files, deleted)
        self._send(200, {"commitUrl": f"{self.state.url}/{repo_id}/commit/{commit['oid']}",
                         "commitOid": commit["oid"], "pullRequestUrl": pr_url})

    def _open_pr(self, repo: Repo, repo_id: str) -> tuple[str, str]:
        repo.prs += 1
        branch = f"refs/pr/{repo.prs}"
        repo.branches[branch] = [repo.branches["main"][-1]]
        return branch, f"{self.state.url}/{repo_id}/discussions/{repo.prs}"

    def _new_pr(self, repo: Repo) -> None:
        with self.state.lock:
            repo.prs += 1
            repo.branches[f"refs/pr/{repo.prs}"] = [repo.branches["main"][-1]]
        self._send(200, {"num": repo.prs})

    def _pr_details(self, repo_id: str, num: int) -> None:
        self._send(200, {"title": "eagle3-zoo upload", "num": num, "createdAt": "2025-01-01T00:00:00.000Z",
                         "status": "open", "repo": {"name": repo_id, "type": "model"}, "isPullRequest": True,
                         "events": [], "changes": {"base": "refs/heads/main"}, "filesWithConflicts": []})

    def _resolve(self, repo_id: str, rev: str, filename: str, head: bool) -> None:
        repo = self._repo(repo_id)
        commit = repo.head(rev) if repo else None
        if commit is None:
            return self._not_found(f"Repository {repo_id}@{rev}", head=head)
        if filename not in commit["files"]:
            return self._not_found(f"Entry {filename}", "EntryNotFound", head)
        data = commit["files"][filename]
        self._send(200, raw=data, head=head, headers={"X-Repo-Commit": commit["oid"],
                                                      "ETag": f'"{git_blob_sha(data)}"'})
