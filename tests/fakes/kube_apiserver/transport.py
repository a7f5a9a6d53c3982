"""The HTTP/1.1 side: request parsing, recording, fault injection, JSON replies and chunked watch streams."""

from __future__ import annotations

import json
import select
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import parse_qs, urlsplit

from .router import Request, Response

if TYPE_CHECKING:
    from .server import FakeKubeApiServer

_BODY_TYPES = ("application/json", "")
_UNSUPPORTED_BODY = ("the body of the request was in an unknown format - accepted media types include: "
                     "application/json, application/yaml, application/vnd.kubernetes.protobuf, application/cbor")


@dataclass
class RequestRecord:
    """One request as the server saw it (`query` decoded, `target` as sent); `status` is None if dropped."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    headers: dict[str, str]
    target: str = ""
    status: int | None = None


class HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, owner: FakeKubeApiServer):
        self.owner = owner
        super().__init__(("127.0.0.1", port), Handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; without TCP_NODELAY, Nagle plus the client's delayed ACK adds
    # ~40 ms to every keep-alive request, which a real API server (Go, TCP_NODELAY by default) does not.
    disable_nagle_algorithm = True
    server: HttpServer

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._untrack(self.connection)

    def _serve(self) -> None:
        owner = self.server.owner
        if owner.is_down:
            return self._drop()
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        body, parse_error = _parse_json(raw)
        record = RequestRecord(self.command, url.path, query, content_type, body,
                               {k.lower(): v for k, v in self.headers.items()}, self.path)
        owner._record(record)
        if owner.latency_s:
            time.sleep(owner.latency_s)
        if owner.is_down:
            return self._drop()
        response = self._choose(owner, url.path, query, content_type, raw, body, parse_error)
        record.status = response.status
        if response.stream is not None:
            self._send_stream(response.stream)
        else:
            self._send(response)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _serve

    def _choose(self, owner: FakeKubeApiServer, path: str, query: dict[str, str], content_type: str,
                raw: bytes, body: Any, parse_error: str | None) -> Response:
        fault = owner._faults.take(self.command, self.path)
        if fault is not None:
            status, fault_body, headers = fault.reply()
            return Response(status, fault_body, headers)
        router = owner._router
        if self.command in ("POST", "PUT") and raw and content_type not in _BODY_TYPES:
            return router.error(415, _UNSUPPORTED_BODY)
        if parse_error is not None:
            return router.error(400, parse_error)
        try:
            return router.handle(Request(self.command, path, query, content_type, body))
        except Exception as exc:  # a bug in the fake must still reach the client as a Status
            return router.error(500, f"Internal error occurred: fake apiserver: {exc!r}")

    def _send(self, response: Response) -> None:
        if isinstance(response.body, (dict, list)):
            data = json.dumps(response.body).encode()
            content_type = "application/json"
        else:
            data = str(response.body or "").encode()
            content_type = "text/plain; charset=utf-8"
        self.send_response(response.status)
        headers = {"Content-Type": content_type, "Cache-Control": "no-cache, private",
                   "Audit-Id": str(uuid.uuid4()), **response.headers, "Content-Length": str(len(data))}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_stream(self, stream: Iterator[dict[str, Any] | None]) -> None:
        self.send_response(200)
        for name, value in (("Content-Type", "application/json"), ("Cache-Control", "no-cache, private"),
                            ("Audit-Id", str(uuid.uuid4())), ("Transfer-Encoding", "chunked")):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.flush()
        try:
            for event in stream:
                if self.server.owner.is_down:
                    return self._drop()
                if event is None:
                    if self._peer_closed():
                        self.close_connection = True
                        return
                    continue
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def _peer_closed(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _drop(self) -> None:
        """Close without any response; SO_LINGER 0 makes the close an RST, like a crashed server."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass


def _parse_json(raw: bytes) -> tuple[Any, str | None]:
    if not raw:
        return None, None
    try:
        return json.loads(raw), None
    except (ValueError, UnicodeDecodeError) as exc:
        return raw.decode("utf-8", "replace"), f"error decoding request body as JSON: {exc}"
