"""A local HTTP server standing in for EC2's IMDSv2 (token, then metadata with the token)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeImds:
    def __init__(self, metadata: dict[str, str], token: str = "tok-123"):
        self.metadata = metadata
        self.token = token
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _reply(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                fake.requests.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._reply(200, fake.token)
                else:
                    self._reply(400)

            def do_GET(self):
                fake.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if self.headers.get("X-aws-ec2-metadata-token") != fake.token:
                    self._reply(401)
                    return
                key = self.path.removeprefix("/latest/")
                if key in fake.metadata:
                    self._reply(200, fake.metadata[key])
                else:
                    self._reply(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeImds:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
