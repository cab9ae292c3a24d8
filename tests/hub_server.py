"""A local stand-in for the Hugging Face Hub: a real HTTP server on 127.0.0.1 answering the endpoints
huggingface_hub 2.4's snapshot_download and HfApi.repo_info call, as the hub answers them, for repos
whose commits are held in memory. Point HF_ENDPOINT at ``server.url``; every request is logged.

- GET /api/models/<repo>/revision/<rev>: the model info (id, sha, siblings);
- GET /api/models/<repo>/tree/<rev>?recursive=...: the file listing (type, oid, size, path; lfs for
  LFS files), one page (no Link header);
- HEAD and GET /<repo>/resolve/<rev>/<file>: X-Repo-Commit, ETag (the git blob sha1; an LFS file's sha256,
  also as X-Linked-Etag with X-Linked-Size), Content-Length; GET sends the bytes. No redirect: the file
  is served where it is asked for, which huggingface_hub takes as the download location.

Errors carry X-Error-Code as the hub's do (RepoNotFound, RevisionNotFound, EntryNotFound), which
huggingface_hub turns into its RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError.
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth")  # stored with git LFS on the hub, as their .gitattributes says


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubRepo:
    """A model repo's commits (sha -> {path: bytes}) and refs (branch -> sha)."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id
        self.commits: dict[str, dict[str, bytes]] = {}
        self.refs: dict[str, str] = {}

    def commit(self, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit of ``files`` on ``branch``; its sha (made of the content and the commit count)."""
        h = hashlib.sha1(str(len(self.commits)).encode())
        for path in sorted(files):
            h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        sha = h.hexdigest()
        self.commits[sha] = dict(files)
        self.refs[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def entry(path: str, data: bytes) -> dict:
    """A file as the tree API lists it."""
    item = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
    if path.endswith(LFS_SUFFIXES):
        item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return item


class HubServer:
    """The server, in a thread; ``log`` holds "METHOD path" of every request, in order."""

    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def repo(self, repo_id: str) -> HubRepo:
        return self.repos.setdefault(repo_id, HubRepo(repo_id))

    def downloads(self) -> list[str]:
        """The files sent (GET .../resolve/...), as <repo>/<rev>/<file>."""
        return [line.split("/resolve/", 1)[0][4:] + "/" + line.split("/resolve/", 1)[1]
                for line in self.log if line.startswith("GET ") and "/resolve/" in line]  # fmt: skip

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # the test reads server.log, not stderr
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
                self.send_response(status)
                for name, value in (headers | {"Content-Length": str(len(data))}).items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def error(self, status: int, code: str, message: str, body: bool, **headers) -> None:
                data = json.dumps({"error": message}).encode()
                self.send(status, data, {"Content-Type": "application/json", "X-Error-Code": code} | headers, body)

            def answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                with server.lock:
                    server.log.append(f"{self.command} {path}")
                api = path.startswith("/api/models/")
                parts = path.removeprefix("/api/models/").lstrip("/").split("/")
                if len(parts) < 4:
                    return self.error(404, "RepoNotFound", "not found", body)
                repo_id, kind, rev, rest = "/".join(parts[:2]), parts[2], parts[3], "/".join(parts[4:])
                repo = server.repos.get(repo_id)
                if repo is None:
                    return self.error(404, "RepoNotFound", f"Repository not found: {repo_id}", body)
                sha = repo.resolve(rev)
                if sha is None:
                    return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
                files = repo.commits[sha]
                if api and kind == "revision":
                    info = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "tags": [],
                            "siblings": [{"rfilename": name} for name in sorted(files)]}  # fmt: skip
                    return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
                if api and kind == "tree":
                    listing = [entry(name, data) for name, data in sorted(files.items())]
                    return self.send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, body)
                if not api and kind == "resolve":
                    if rest not in files:
                        return self.error(404, "EntryNotFound", f"{rest} not found", body, **{"X-Repo-Commit": sha})
                    data = files[rest]
                    item = entry(rest, data)
                    headers = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream"}
                    if "lfs" in item:
                        etag = item["lfs"]["oid"]
                        headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
                    headers["ETag"] = f'"{item["lfs"]["oid"] if "lfs" in item else item["oid"]}"'
                    return self.send(200, data, headers, body)
                return self.error(404, "EntryNotFound", f"no such endpoint: {path}", body)

        return Handler


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file of a model folder (save_pretrained's), by its path in the folder."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def tiny_chat_model(folder: Path, data_csv: Path) -> dict[str, bytes]:
    """A tiny demo model built in ``folder`` (its tokenizer trained on ``data_csv``) and its files, as a hub repo
    serves them: save_pretrained's weights, config and tokenizer with its chat template."""
    from workflow_scripts.model.demo_model import build_model, texts_from, train_tokenizer

    tokenizer = train_tokenizer(texts_from(str(data_csv)), 512)
    build_model(tokenizer, 128, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder_files(folder)
