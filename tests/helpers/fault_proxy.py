"""A proxy in front of a real vLLM server that injects the faults a cluster sees: a server answering HTTP 500 to the
weight updates (which only the main process sends), updates lost on their way (acknowledged, never applied), and a
server that is gone (nothing listens any more). Everything else is forwarded unchanged.

The mode is set over HTTP (``POST /_fault/<mode>``), so the process that injects a fault need not be the one that
started the proxy: ``pass``, ``500_on_weights``, ``drop_weights``, ``dead`` (after which the proxy stops listening).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

WEIGHT_PATHS = ("/collective_rpc", "/v1/load_lora_adapter")
MODES = ("pass", "500_on_weights", "drop_weights", "dead")


class FaultProxy:
    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.mode = "pass"
        self.injected: list[str] = []  # "mode path" of every request answered by a fault
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _forward(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                path = self.path.split("?", 1)[0]
                if method == "POST" and path.startswith("/_fault/"):
                    mode = path.removeprefix("/_fault/")
                    if mode not in MODES:
                        self._answer(400, f"unknown mode {mode}".encode(), "text/plain")
                        return
                    proxy.mode = mode
                    self._answer(200, b"{}")
                    if mode == "dead":
                        threading.Thread(target=proxy.stop, daemon=True).start()
                    return
                if proxy.mode == "500_on_weights" and path in WEIGHT_PATHS:
                    proxy.injected.append(f"500 {path}")
                    self._answer(500, b'{"error": "injected: internal server error"}')
                    return
                if proxy.mode == "drop_weights" and path in WEIGHT_PATHS:
                    proxy.injected.append(f"drop {path}")
                    self._answer(200, b"{}")
                    return
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                response = httpx.request(method, proxy.target + self.path, content=body, headers=headers, timeout=600)
                self._answer(response.status_code, response.content, response.headers.get("content-type", ""))

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.mode != "dead":
            self.stop()
