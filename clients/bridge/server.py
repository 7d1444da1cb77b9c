"""HTTP(S) front of the gateway: the endpoints of android_client/PROTOCOL.md.

Standard library only (``http.server.ThreadingHTTPServer``, one thread per phone
connection), so a long poll of one phone never holds up another.
"""

from __future__ import annotations

import json
import logging
import re
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from flowerbed.clients.bridge.codec import CONTENT_TYPE
from flowerbed.clients.bridge.gateway import SUPPORTED_VERSIONS, Gateway, Phone
from flowerbed.clients.bridge.tasks import ProtocolError

log = logging.getLogger("flowerbed.bridge")

MAX_JSON_BYTES = 64 * 1024
"""Largest JSON request body (hello, complete, fail)."""
_VERSION_RE = re.compile(r"^/v(\d+)(/|$)")
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    # -- plumbing ---------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.client_address[0], format % args)

    @property
    def gateway(self) -> Gateway:
        return self.server.gateway

    def _address(self) -> str:
        return f"{self.client_address[0]}:{self.client_address[1]}"

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(raw)

    def _send_empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _content_length(self) -> int:
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.isdigit():
            raise ProtocolError(411, "Content-Length header required")
        return int(raw)

    def _read_body(self, limit: int) -> bytes:
        length = self._content_length()
        if length > limit:
            self.close_connection = True  # the body stays unread
            raise ProtocolError(413, f"body of {length} bytes exceeds {limit}")
        return self.rfile.read(length)

    def _read_json(self) -> Any:
        raw = self._read_body(MAX_JSON_BYTES)
        try:
            return json.loads(raw.decode("utf-8")) if raw else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ProtocolError(400, f"body is not UTF-8 JSON: {err}") from err

    def _dispatch(self, method: str) -> None:
        phone: Phone | None = None
        try:
            url = urlsplit(self.path)
            match = _VERSION_RE.match(url.path)
            if match and int(match.group(1)) not in SUPPORTED_VERSIONS:
                self.close_connection = True
                raise ProtocolError(
                    426,
                    f"protocol version {match.group(1)} not supported",
                    supported=list(SUPPORTED_VERSIONS),
                )
            if not match:
                raise ProtocolError(
                    404, f"no endpoint {url.path}; the API is under /v1"
                )
            phone = self.gateway.authenticate(
                self.headers.get("Authorization"), self._address()
            )
            parts = url.path.strip("/").split("/")[1:]
            query = parse_qs(url.query)
            self._route(method, parts, query, phone)
        except ProtocolError as err:
            if err.status == 401:
                self.close_connection = True
            elif phone is not None and err.status in (400, 409, 413):
                # 409 is an ordinary resume; 400 and 413 reject the phone's data.
                log.log(
                    logging.INFO if err.status == 409 else logging.WARNING,
                    "phone %s at %s: %s %s rejected (%s): %s",
                    phone.name,
                    self._address(),
                    method,
                    self.path,
                    err.status,
                    err.reason,
                )
            self._send_json(err.status, err.body())
        except (ConnectionError, TimeoutError):
            self.close_connection = True

    def _route(
        self, method: str, parts: list[str], query: dict[str, list[str]], phone: Phone
    ) -> None:
        if method == "POST" and parts == ["hello"]:
            self._send_json(200, self.gateway.hello(phone, self._read_json()))
        elif method == "GET" and parts == ["task"]:
            self._poll(phone, query)
        elif method == "GET" and len(parts) == 3 and parts[::2] == ["task", "arrays"]:
            self._arrays(phone, parts[1])
        elif method == "PUT" and len(parts) == 3 and parts[::2] == ["task", "result"]:
            self._upload(phone, parts[1], query)
        elif (
            method == "POST" and len(parts) == 3 and parts[::2] == ["task", "complete"]
        ):
            task = self.gateway.task(phone, parts[1])
            body = self._read_json()
            metrics = body.get("metrics") if isinstance(body, dict) else None
            task.complete(metrics)
            log.info("phone %s: task %s accepted", phone.name, task.task_id)
            self._send_json(200, {"status": "accepted"})
        elif method == "POST" and len(parts) == 3 and parts[::2] == ["task", "fail"]:
            task = self.gateway.task(phone, parts[1])
            body = self._read_json()
            reason = body.get("reason") if isinstance(body, dict) else None
            task.fail(str(reason or "no reason given"))
            log.info("phone %s: gave up task %s: %s", phone.name, task.task_id, reason)
            self._send_json(200, {"status": "failed"})
        else:
            raise ProtocolError(404, f"no endpoint {method} /v1/{'/'.join(parts)}")

    # -- endpoints --------------------------------------------------------------------
    def _poll(self, phone: Phone, query: dict[str, list[str]]) -> None:
        raw = query.get("wait", ["0"])[-1]
        try:
            wait_s = float(raw)
        except ValueError:
            raise ProtocolError(
                400, f"wait={raw!r} is not a number of seconds"
            ) from None
        task = self.gateway.poll(phone, wait_s)
        if task is None:
            self._send_empty(HTTPStatus.NO_CONTENT)
        else:
            self._send_json(200, task.describe())

    def _arrays(self, phone: Phone, task_id: str) -> None:
        blob = self.gateway.task(phone, task_id).arrays_blob
        start, end, status = 0, len(blob) - 1, 200
        header = self.headers.get("Range")
        if header is not None:
            match = _RANGE_RE.match(header.strip())
            start = int(match.group(1)) if match else -1
            if match and match.group(2):
                end = min(end, int(match.group(2)))
            if not match or start >= len(blob) or start > end:
                self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                self.send_header("Content-Range", f"bytes */{len(blob)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(blob)}")
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(blob[start : end + 1])

    def _upload(self, phone: Phone, task_id: str, query: dict[str, list[str]]) -> None:
        try:
            offset = int(query["offset"][-1])
            total = int(query["total"][-1])
        except (KeyError, ValueError):
            raise ProtocolError(
                400, "offset and total must be given as integers"
            ) from None
        task = self.gateway.task(phone, task_id)
        settings = self.gateway.settings
        length = self._content_length()
        # Refuse oversize requests before reading: their body is never buffered.
        if total > settings.max_upload_bytes:
            self.close_connection = True
            task.refuse_upload(total, settings.max_upload_bytes)
        if length > settings.chunk_bytes:
            self.close_connection = True
            raise ProtocolError(
                400,
                f"chunk of {length} bytes exceeds chunk_bytes={settings.chunk_bytes}",
            )
        data = self.rfile.read(length)
        received = task.receive_chunk(
            offset, total, data, settings.max_upload_bytes, settings.chunk_bytes
        )
        self._send_json(200, {"received": received})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], gateway: Gateway) -> None:
        super().__init__(address, _Handler)
        self.gateway = gateway


class GatewayServer:
    """The gateway's HTTP(S) server, run in a background thread.

    Parameters
    ----------
    gateway : Gateway
        The protocol logic.
    host, port : str, int
        Where to listen (port 0 picks a free one; see :attr:`port`).
    certfile, keyfile : str | None
        PEM certificate chain and key: serve HTTPS. Both or neither.
    """

    def __init__(
        self,
        gateway: Gateway,
        host: str = "127.0.0.1",
        port: int = 8470,
        certfile: str | None = None,
        keyfile: str | None = None,
    ) -> None:
        if (certfile is None) != (keyfile is None):
            raise ValueError("HTTPS needs both a certificate file and a key file")
        self.gateway = gateway
        self._httpd = _Server((host, port), gateway)
        self.tls = certfile is not None
        if certfile is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
            # Handshake in the connection's own thread, not in the accept loop.
            self._httpd.socket = context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="bridge-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = cast(str, self._httpd.server_address[0])
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self) -> GatewayServer:
        self._thread.start()
        log.info("flowerbed bridge listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving, then stop the gateway's relays."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self.gateway.stop()
