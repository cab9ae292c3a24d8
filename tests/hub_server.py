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

And the upload API that HfApi.create_repo, create_branch and create_commit (upload_folder's) call, with plain LFS
(HF_HUB_DISABLE_XET=1: huggingface_hub's Xet protocol is not served), each asking for ``Authorization: Bearer
<token>`` when the server has a ``token`` (401 otherwise, as the hub answers a write without one):

- POST /api/repos/create ({name, organization, visibility}): the repo with its first commit (.gitattributes, as
  the hub makes it); 409 when it exists (create_repo's exist_ok takes that);
- POST /api/models/<repo>/branch/<branch> ({startingPoint}): a branch at main (or that revision); 409 when it is;
- POST /api/validate-yaml: no errors (README.md's front matter is checked by the hub; here it is read back);
- POST /api/models/<repo>/preupload/<rev> ({files: path, sample, size}): each file's uploadMode (lfs for the
  LFS_SUFFIXES or 10 MB and over, else regular) and the oid of the file the revision has at that path;
- POST /<repo>.git/info/lfs/objects/batch (operation upload, basic transfer): an upload href (PUT
  /lfs-upload/<oid>, the bytes, checked against their sha256) and a verify href for each object not held yet;
- POST /api/models/<repo>/commit/<rev> (NDJSON: a header, then file items with base64 content, lfsFile items
  naming an uploaded object by sha256, deletedFile items): a new commit on the branch, its files the parent's
  with these changes; answers commitUrl and commitOid.
"""

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth")  # stored with git LFS on the hub, as their .gitattributes says
LFS_SIZE = 10 * 1024 * 1024  # a file this large goes through LFS whatever its name (the hub's preupload says so)
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


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


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_SIZE


def entry(path: str, data: bytes) -> dict:
    """A file as the tree API lists it."""
    item = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
    if is_lfs(path, len(data)):
        item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return item


class HubServer:
    """The server, in a thread; ``log`` holds "METHOD path" of every request, in order."""

    def __init__(self, token: str | None = None):
        self.repos: dict[str, HubRepo] = {}
        self.token = token  # writes ask for it (Authorization: Bearer <token>)
        self.lfs: dict[str, bytes] = {}  # uploaded LFS objects by sha256
        self.created: list[dict] = []  # the create-repo requests' bodies (name, organization, visibility)
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

    def uploads(self) -> list[str]:
        """The files committed (POST .../commit/... items), as <repo>/<path>, in order."""
        return [line.split(" ", 1)[1] for line in self.log if line.startswith("COMMIT ")]

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

            def do_POST(self):
                self.write()

            def do_PUT(self):
                self.write()

            def body(self) -> bytes:
                """The request's body: Content-Length bytes, or chunked (a streamed file)."""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return data
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def reply(self, status: int, obj) -> None:
                self.send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"}, True)

            def write(self) -> None:
                """The upload API (the module's docstring), each call logged as "METHOD path"."""
                path, data = unquote(urlsplit(self.path).path), self.body()
                with server.lock:
                    server.log.append(f"{self.command} {path}")
                signed = path.startswith("/lfs-upload/")  # a storage URL the hub signed: no token, as on S3
                if server.token and not signed and self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self.error(401, "Unauthorized", "Invalid username or password.", True)
                if path == "/api/validate-yaml":
                    return self.reply(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    request = json.loads(data)
                    repo_id = f"{request.get('organization') or 'user'}/{request['name']}"
                    with server.lock:
                        server.created.append(request)
                        if repo_id in server.repos:  # the hub's 409 names the repo's url too (create_repo reads it)
                            answer = {"error": "You already created this model repo", "url": f"{server.url}/{repo_id}"}
                            headers = {"Content-Type": "application/json", "X-Error-Code": "RepoExists"}
                            return self.send(409, json.dumps(answer).encode(), headers, True)
                        server.repo(repo_id).commit({".gitattributes": GITATTRIBUTES})
                    return self.reply(200, {"url": f"{server.url}/{repo_id}", "name": repo_id})
                if path.startswith("/lfs-upload/"):
                    oid = path.rsplit("/", 1)[1]
                    if hashlib.sha256(data).hexdigest() != oid:
                        return self.error(400, "BadRequest", "sha256 does not match the content", True)
                    server.lfs[oid] = data
                    return self.send(200, b"", {}, True)
                if path.startswith("/lfs-verify/"):
                    request = json.loads(data)
                    found = server.lfs.get(request["oid"])
                    ok = found is not None and len(found) == request["size"]
                    return self.reply(200, {}) if ok else self.error(404, "EntryNotFound", "not uploaded", True)
                if path.endswith(".git/info/lfs/objects/batch"):
                    return self.lfs_batch(json.loads(data))
                parts = path.removeprefix("/api/models/").split("/")
                if not path.startswith("/api/models/") or len(parts) < 4:
                    return self.error(404, "EntryNotFound", f"no such endpoint: {path}", True)
                repo_id, kind, rev = "/".join(parts[:2]), parts[2], "/".join(parts[3:])
                repo = server.repos.get(repo_id)
                if repo is None:
                    return self.error(404, "RepoNotFound", f"Repository not found: {repo_id}", True)
                if kind == "branch":
                    start = repo.resolve((json.loads(data or b"{}")).get("startingPoint") or "main")
                    if rev in repo.refs:
                        return self.error(409, "Conflict", f"Reference {rev} already exists", True)
                    repo.refs[rev] = start
                    return self.reply(200, {})
                sha = repo.resolve(rev)
                if sha is None:
                    return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}", True)
                if kind == "preupload":
                    return self.preupload(repo.commits[sha], json.loads(data)["files"])
                if kind == "commit":
                    return self.commit(repo, rev, data)
                return self.error(404, "EntryNotFound", f"no such endpoint: {path}", True)

            def preupload(self, files: dict[str, bytes], asked: list[dict]) -> None:
                answer = []
                for item in asked:
                    old = files.get(item["path"])
                    oid = None if old is None else entry(item["path"], old).get("lfs", {}).get("oid")
                    oid = oid or (None if old is None else git_blob_sha1(old))
                    mode = "lfs" if is_lfs(item["path"], item["size"]) else "regular"
                    answer.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
                self.reply(200, {"files": answer})

            def lfs_batch(self, request: dict) -> None:
                if request.get("operation") != "upload" or "basic" not in request.get("transfers", ["basic"]):
                    return self.error(400, "BadRequest", "only basic uploads are served here", True)
                objects = []
                for obj in request["objects"]:
                    item = {"oid": obj["oid"], "size": obj["size"]}
                    if obj["oid"] not in server.lfs:  # no actions: the hub has it already
                        item["actions"] = {
                            "upload": {"href": f"{server.url}/lfs-upload/{obj['oid']}"},
                            "verify": {"href": f"{server.url}/lfs-verify/{obj['oid']}"},
                        }
                    objects.append(item)
                self.reply(200, {"transfer": "basic", "objects": objects})

            def commit(self, repo: HubRepo, branch: str, data: bytes) -> None:
                items = [json.loads(line) for line in data.splitlines() if line.strip()]
                if not items or items[0].get("key") != "header":
                    return self.error(400, "BadRequest", "the commit's first line is its header", True)
                files = dict(repo.commits[repo.resolve(branch)])
                for item in items[1:]:
                    key, value = item["key"], item["value"]
                    if key == "file":
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif key == "lfsFile":
                        if value["oid"] not in server.lfs:
                            return self.error(400, "BadRequest", f"{value['path']}: LFS object not uploaded", True)
                        files[value["path"]] = server.lfs[value["oid"]]
                    elif key == "deletedFile":
                        files.pop(value["path"], None)
                    else:
                        return self.error(400, "BadRequest", f"commit item {key} is not served here", True)
                    with server.lock:
                        server.log.append(f"COMMIT {repo.repo_id}/{value['path']}")
                sha = repo.commit(files, branch)
                self.reply(200, {"commitUrl": f"{server.url}/{repo.repo_id}/commit/{sha}", "commitOid": sha,
                                 "success": True})  # fmt: skip

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
