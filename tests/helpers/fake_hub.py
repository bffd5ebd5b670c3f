"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that ``huggingface_hub`` uses to create a model
repo and commit files to it (regular uploads, no LFS/Xet), on 127.0.0.1. Point ``HF_ENDPOINT`` at ``url``.

Committed files land in ``repos[repo_id][path] = bytes``; ``received`` holds the raw body of every request (every
byte that went up, commit messages and file contents included). ``fail_next`` makes the next N commit calls answer HTTP ``fail_status`` (500 unless set).
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str]] = []
        self.received: list[bytes] = []
        self.fail_next = 0
        self.fail_status = 500
        self.commits = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    return self.rfile.read(length)
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = b""
                    while True:
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return chunks
                        chunks += self.rfile.read(size)
                        self.rfile.readline()
                return b""

            def _reply(self, status: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                if self.path.startswith("/api/whoami"):
                    return self._reply(200, {"name": "tester", "type": "user", "orgs": [], "auth": {}})
                if self.path.startswith("/api/models/"):
                    repo_id = "/".join(self.path.split("/")[3:5]).split("?")[0]
                    if repo_id in hub.repos:
                        siblings = [{"rfilename": name} for name in hub.repos[repo_id]]
                        return self._reply(200, {"id": repo_id, "sha": "0" * 40, "siblings": siblings})
                return self._reply(404, {"error": "not found"})

            def do_POST(self):
                body = self._body()
                hub.requests.append(("POST", self.path))
                hub.received.append(self.path.encode() + b"\n" + body)
                if self.path.startswith("/api/validate-yaml"):  # the model card's metadata: always valid here
                    return self._reply(200, {"errors": [], "warnings": []})
                if self.path == "/api/repos/create":
                    payload = json.loads(body or b"{}")
                    repo_id = f"{payload.get('organization') or 'tester'}/{payload['name']}"
                    hub.repos.setdefault(repo_id, {})
                    return self._reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                parts = self.path.split("?")[0].split("/")
                if len(parts) >= 6 and parts[1] == "api" and parts[2] == "models":
                    repo_id, action = f"{parts[3]}/{parts[4]}", parts[5]
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                        return self._reply(200, {"files": modes})
                    if action == "commit":
                        if hub.fail_next > 0:
                            hub.fail_next -= 1
                            return self._reply(hub.fail_status, {"error": "internal error (fake hub)"})
                        files = hub.repos.setdefault(repo_id, {})
                        for line in body.decode().splitlines():
                            entry = json.loads(line)
                            if entry.get("key") == "file":
                                value = entry["value"]
                                files[value["path"]] = base64.b64decode(value["content"])
                            elif entry.get("key") == "deletedFile":
                                files.pop(entry["value"]["path"], None)
                        hub.commits += 1
                        oid = f"{hub.commits:040d}"
                        return self._reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid})
                return self._reply(404, {"error": f"fake hub has no {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
