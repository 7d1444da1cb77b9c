"""HTTP(S) front of the gateway: the endpoints of android_client/PROTOCOL.md.

An ``asyncio`` server in one background thread. Every connection is a coroutine,
not a thread, so idle, slow and long-polling phones cost a socket and a little
memory each; the blocking work of a request (checking and decoding a JSON body,
registering a node with the SuperLink, decoding a result) runs in a bounded pool of
``workers`` threads.

Nothing a client sends can pin the server (docs/bridge.md, "Security"):

- a connection must deliver a whole request head within ``idle_timeout_s``; a body
  or an answer must move at ``min_bytes_per_s`` after ``read_timeout_s`` of grace;
- at most ``max_connections`` are open: a new connection closes one that waits
  for a request head (a slow or idle client, never a request in progress; one that
  never completed a request first, then the longest waiting), and is refused with
  ``503`` when every connection is busy;
- heads over :data:`MAX_HEAD_BYTES`, bodies over the endpoint's limit, malformed
  request lines, headers or ``Content-Length``, chunked bodies, JSON that is invalid,
  too deep or holds NaN: all answered with a 4xx JSON error; a JSON body is checked
  and decoded in time linear in its length, under a CPU budget, off the event loop
  (:mod:`flowerbed.clients.bridge.json_body`);
- a body is read whole before the request is answered, or the connection is
  closed with the answer, so keep-alive never reads a stale body as a request;
- a phone may have ``max_requests_per_phone`` requests in progress; more get 429;
- an unexpected error answers ``500`` and closes the connection; it is logged, at
  a limited rate, and never ends the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from flowerbed.clients.bridge.codec import CONTENT_TYPE
from flowerbed.clients.bridge.gateway import (
    PATH_VERSION,
    SUPPORTED_VERSIONS,
    Gateway,
    Phone,
)
from flowerbed.clients.bridge.json_body import parse_json
from flowerbed.clients.bridge.tasks import ProtocolError

log = logging.getLogger("flowerbed.bridge")

PROGRAM_CONTENT_TYPE = "application/octet-stream"
MAX_JSON_BYTES = 64 * 1024
"""Largest JSON request body (hello, complete, fail)."""
MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (request line and headers)."""
MAX_HEADERS = 64
_VERSION_RE = re.compile(r"^/v(\d{1,6})(/|$)")
_RANGE_RE = re.compile(r"^bytes=([0-9]{1,15})-([0-9]{0,15})$")
_DIGITS_RE = re.compile(r"^[0-9]{1,15}$")
_TOKEN_CHARS_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_REQUEST_LINE_RE = re.compile(r"^([A-Z]{1,16}) (/[!-~]*) HTTP/1\.([01])$")

T = TypeVar("T")


class _Close(Exception):
    """End the connection now, answering nothing more."""


@dataclass
class _Request:
    method: str
    target: str
    minor: int
    headers: dict[str, str]
    body: bytes = b""
    keep_alive: bool = True
    consumed: bool = False
    """True once the body (if any) has been read: the next bytes are a new request."""


@dataclass(eq=False)
class _Conn:
    """One open connection, as the connection limit sees it."""

    writer: asyncio.StreamWriter
    waiting: bool = True
    """True while it waits for a request head (evictable)."""
    since: float = field(default_factory=time.monotonic)
    served: int = 0
    """Requests answered on it: connections that never sent one go first."""
    task: asyncio.Task[None] | None = None
    """The coroutine serving it (cancelled when the server stops)."""


def _finite(raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ProtocolError(400, f"{what}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ProtocolError(400, f"{what}={raw!r} must be a finite number")
    return value


def _integer(query: dict[str, list[str]], name: str) -> int:
    raw = query.get(name, [""])[-1]
    if not _DIGITS_RE.match(raw):
        raise ProtocolError(
            400, f"{name} must be a non-negative integer (decimal digits), got {raw!r}"
        )
    return int(raw)


def _status_line(status: int) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Status"
    return f"HTTP/1.1 {status} {phrase}\r\n"


class _Protocol:
    """The request loop of every connection, on the server's event loop."""

    def __init__(
        self,
        gateway: Gateway,
        tls: ssl.SSLContext | None,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.gateway = gateway
        self.settings = gateway.settings
        self.tls = tls
        self.pool = pool
        self.conns: set[_Conn] = set()
        self.wakeups: dict[str, asyncio.Event] = {}

    # -- connection limit -----------------------------------------------------------
    def _admit(self, conn: _Conn) -> bool:
        if len(self.conns) >= self.settings.max_connections:
            idle = [c for c in self.conns if c.waiting]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: (c.served > 0, c.since))
            self.conns.discard(oldest)
            oldest.writer.transport.abort()
        self.conns.add(conn)
        return True

    async def connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = _Conn(writer, task=asyncio.current_task())
        peer = writer.get_extra_info("peername") or ("?", 0)
        address = f"{peer[0]}:{peer[1]}"
        if not self._admit(conn):
            self.gateway.refusals.log(
                "busy",
                logging.WARNING,
                "refused connection from %s: %d connections, all busy",
                address,
                len(self.conns),
            )
            if self.tls is None:  # a TLS client would need a handshake first
                body = b'{"error": "gateway busy; retry later"}'
                writer.write(
                    (
                        _status_line(503) + "Content-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\nRetry-After: 5\r\n"
                        "Connection: close\r\n\r\n"
                    ).encode("latin-1")
                    + body
                )
            writer.close()
            return
        try:
            if self.tls is not None:
                await writer.start_tls(
                    self.tls, ssl_handshake_timeout=self.settings.read_timeout_s
                )
            while True:
                conn.waiting, conn.since = True, time.monotonic()
                try:
                    request = await self._read_head(reader)
                except ProtocolError as err:
                    await self._send_json(writer, err.status, err.body(), close=True)
                    break
                conn.waiting = False
                if request is None:
                    break
                if not await self._serve(request, reader, writer, address):
                    break
                conn.served += 1
        except (_Close, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away, stalled or sent garbage: just close
        finally:
            self.conns.discard(conn)
            await self._close_quietly(writer)

    async def _close_quietly(self, writer: asyncio.StreamWriter) -> None:
        """Close after the last answer is flushed; abort if the client stalls."""
        if writer.transport.is_closing():
            writer.transport.abort()
            return
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), self.settings.read_timeout_s)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()

    # -- reading --------------------------------------------------------------------
    async def _read_head(self, reader: asyncio.StreamReader) -> _Request | None:
        """The next request's head, None at a clean end of the connection."""
        try:
            raw = await asyncio.wait_for(
                reader.readuntil(b"\r\n\r\n"), self.settings.idle_timeout_s
            )
        except asyncio.IncompleteReadError as err:
            if err.partial.strip():
                raise _Close() from None
            return None
        except asyncio.LimitOverrunError:
            raise ProtocolError(
                431, f"request head over {MAX_HEAD_BYTES} bytes", close=True
            ) from None
        lines = raw.decode("latin-1").split("\r\n")[:-2]
        match = _REQUEST_LINE_RE.match(lines[0]) if lines else None
        if match is None:
            raise ProtocolError(400, "malformed request line", close=True)
        if len(lines) - 1 > MAX_HEADERS:
            raise ProtocolError(431, f"more than {MAX_HEADERS} headers", close=True)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not _TOKEN_CHARS_RE.match(name):
                raise ProtocolError(400, "malformed header line", close=True)
            key = name.lower()
            if key in headers and key in ("content-length", "authorization", "host"):
                raise ProtocolError(400, f"header {name} repeated", close=True)
            headers[key] = value.strip(" \t")
        minor = int(match.group(3))
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection and (
            minor == 1 or "keep-alive" in connection
        )
        no_body = (
            "transfer-encoding" not in headers
            and headers.get("content-length", "0") == "0"
        )
        return _Request(
            match.group(1), match.group(2), minor, headers, b"", keep_alive, no_body
        )

    async def _read_body(
        self,
        request: _Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        limit: int,
    ) -> None:
        """Read the body whole (``Content-Length``; chunked bodies are refused)."""
        if "transfer-encoding" in request.headers:
            raise ProtocolError(
                411, "chunked bodies are not accepted; send Content-Length", close=True
            )
        raw = request.headers.get("content-length")
        if raw is None:
            request.consumed = True
            return
        if not _DIGITS_RE.match(raw):
            raise ProtocolError(
                400, f"Content-Length {raw!r} is not a number of bytes", close=True
            )
        length = int(raw)
        if length == 0:
            request.consumed = True
            return
        if length > limit:
            raise ProtocolError(
                413, f"body of {length} bytes exceeds {limit}", close=True
            )
        if request.headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.body = await asyncio.wait_for(
            reader.readexactly(length), self._transfer_s(length)
        )
        request.consumed = True

    def _transfer_s(self, nbytes: int) -> float:
        return self.settings.read_timeout_s + nbytes / self.settings.min_bytes_per_s

    # -- writing --------------------------------------------------------------------
    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        head = _status_line(status)
        if body or status not in (204, 304):
            head += f"Content-Type: {content_type}\r\n"
        head += f"Content-Length: {len(body)}\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        if close:
            head += "Connection: close\r\n"
        writer.write(head.encode("latin-1") + b"\r\n")
        writer.write(body)
        await asyncio.wait_for(writer.drain(), self._transfer_s(len(body)))

    async def _send_json(
        self, writer: asyncio.StreamWriter, status: int, body: Any, close: bool = False
    ) -> None:
        raw = json.dumps(body).encode("utf-8")
        await self._send(writer, status, raw, close=close)

    # -- dispatch -------------------------------------------------------------------
    async def _serve(
        self,
        request: _Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        address: str,
    ) -> bool:
        """Answer one request; False when the connection must close."""
        phone: Phone | None = None
        try:
            phone = await self._authorise(request, address)
            phone.in_flight += 1
            try:
                await self._route(request, reader, writer, phone, address)
            finally:
                phone.in_flight -= 1
            return request.keep_alive
        except ProtocolError as err:
            # Close unless the request was read whole: an unread body would be
            # taken for the next request.
            close = err.close or not request.consumed or not request.keep_alive
            if phone is not None and err.status in (400, 413):
                self.gateway.refusals.log(
                    f"rejected:{phone.name}",
                    logging.WARNING,
                    "phone %s at %s: %s %s rejected (%s): %s",
                    phone.name,
                    address,
                    request.method,
                    urlsplit(request.target).path,
                    err.status,
                    err.reason,
                )
            await self._send_json(writer, err.status, err.body(), close=close)
            return not close
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, _Close):
            raise
        except Exception:
            self.gateway.refusals.log(
                "internal",
                logging.ERROR,
                "internal error answering %s %s from %s",
                request.method,
                urlsplit(request.target).path,
                address,
                exc_info=True,
            )
            await self._send_json(
                writer, 500, {"error": "internal gateway error"}, close=True
            )
            return False

    async def _authorise(self, request: _Request, address: str) -> Phone:
        path = urlsplit(request.target).path
        match = _VERSION_RE.match(path)
        if match and int(match.group(1)) != PATH_VERSION:
            raise ProtocolError(
                426,
                f"API path /v{match.group(1)} not supported; the API is under "
                f"/v{PATH_VERSION}",
                supported=list(SUPPORTED_VERSIONS),
            )
        if not match:
            raise ProtocolError(404, f"no endpoint {path}; the API is under /v1")
        phone = self.gateway.authenticate(request.headers.get("authorization"), address)
        if phone.in_flight >= self.settings.max_requests_per_phone:
            raise ProtocolError(
                429,
                f"at most {self.settings.max_requests_per_phone} requests of one "
                "phone at a time",
            )
        return phone

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking gateway work in the worker pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, fn, *args)

    async def _route(
        self,
        request: _Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        phone: Phone,
        address: str,
    ) -> None:
        url = urlsplit(request.target)
        parts = url.path.strip("/").split("/")[1:]
        query = parse_qs(url.query)
        method = request.method
        is_upload = (
            method == "PUT" and len(parts) == 3 and parts[::2] == ["task", "result"]
        )
        if is_upload:
            await self._upload(request, reader, writer, phone, parts[1], query)
            return
        await self._read_body(request, reader, writer, MAX_JSON_BYTES)
        if method == "POST" and parts == ["hello"]:
            body = await self._call(parse_json, request.body)
            answer = await self._call(self.gateway.hello, phone, body)
            await self._send_json(writer, 200, answer)
        elif method == "GET" and parts == ["task"]:
            await self._poll(writer, phone, query)
        elif method == "GET" and len(parts) == 3 and parts[::2] == ["task", "arrays"]:
            blob = self.gateway.task(phone, parts[1]).arrays_blob
            await self._send_ranged(request, writer, blob, CONTENT_TYPE)
        elif method == "GET" and len(parts) == 2 and parts[0] == "program":
            blob = self.gateway.program_blob(parts[1])
            await self._send_ranged(request, writer, blob, PROGRAM_CONTENT_TYPE)
        elif (
            method == "POST" and len(parts) == 3 and parts[::2] == ["task", "complete"]
        ):
            task = self.gateway.task(phone, parts[1])
            body = await self._call(parse_json, request.body)
            metrics = body.get("metrics") if isinstance(body, dict) else None
            await self._call(task.complete, metrics)
            log.info("phone %s: task %s accepted", phone.name, task.task_id)
            await self._send_json(writer, 200, {"status": "accepted"})
        elif method == "POST" and len(parts) == 3 and parts[::2] == ["task", "fail"]:
            task = self.gateway.task(phone, parts[1])
            body = await self._call(parse_json, request.body)
            reason = body.get("reason") if isinstance(body, dict) else None
            await self._call(task.fail, f"{reason or 'no reason given'!s:.500}")
            log.info(
                "phone %s: gave up task %s: %.200s", phone.name, task.task_id, reason
            )
            await self._send_json(writer, 200, {"status": "failed"})
        else:
            raise ProtocolError(404, f"no endpoint {method} /v1/{'/'.join(parts)}")

    # -- endpoints --------------------------------------------------------------------
    def wake(self, phone_name: str) -> None:
        """A task was offered to ``phone_name``: wake its long polls (loop thread)."""
        event = self.wakeups.get(phone_name)
        if event is not None:
            event.set()

    async def _poll(
        self, writer: asyncio.StreamWriter, phone: Phone, query: dict[str, list[str]]
    ) -> None:
        wait_s = _finite(query.get("wait", ["0"])[-1], "wait")
        wait_s = min(max(wait_s, 0.0), self.settings.max_poll_s)
        deadline = time.monotonic() + wait_s
        event = self.wakeups.setdefault(phone.name, asyncio.Event())
        while True:
            event.clear()
            task = self.gateway.open_task(phone)  # also marks the phone as alive
            remaining = deadline - time.monotonic()
            if task is not None or remaining <= 0:
                break
            # Wake at least every second to keep the phone marked alive.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, 1.0))
        if task is None:
            await self._send(writer, HTTPStatus.NO_CONTENT, b"")
        else:
            await self._send_json(writer, 200, task.describe())

    async def _send_ranged(
        self,
        request: _Request,
        writer: asyncio.StreamWriter,
        blob: bytes,
        content_type: str,
    ) -> None:
        """Send ``blob``, or the part a ``Range: bytes=a-[b]`` header asks for (206)."""
        start, end, status = 0, len(blob) - 1, 200
        header = request.headers.get("range")
        if header is not None:
            match = _RANGE_RE.match(header.strip())
            start = int(match.group(1)) if match else -1
            if match and match.group(2):
                end = min(end, int(match.group(2)))
            if not match or start >= len(blob) or start > end:
                await self._send(
                    writer,
                    HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                    b"",
                    headers={"Content-Range": f"bytes */{len(blob)}"},
                )
                return
            status = 206
        headers = {"Accept-Ranges": "bytes"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{len(blob)}"
        await self._send(
            writer, status, blob[start : end + 1], content_type, headers=headers
        )

    async def _upload(
        self,
        request: _Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        phone: Phone,
        task_id: str,
        query: dict[str, list[str]],
    ) -> None:
        offset, total = _integer(query, "offset"), _integer(query, "total")
        task = self.gateway.task(phone, task_id)
        settings = self.settings
        # Refuse an oversize upload before reading: its body is never buffered.
        if total > settings.max_upload_bytes:
            request.keep_alive = False
            task.refuse_upload(total, settings.max_upload_bytes)
        await self._read_body(request, reader, writer, settings.chunk_bytes)
        received = task.receive_chunk(
            offset, total, request.body, settings.max_upload_bytes, settings.chunk_bytes
        )
        await self._send_json(writer, 200, {"received": received})


class GatewayServer:
    """The gateway's HTTP(S) server, run on an event loop in a background thread.

    Parameters
    ----------
    gateway : Gateway
        The protocol logic; its settings hold the connection limits and timeouts.
    host, port : str, int
        Where to listen (port 0 picks a free one; see :attr:`port`).
    certfile, keyfile : str | None
        PEM certificate chain and key: serve HTTPS. Both or neither.

    Raises
    ------
    ValueError
        Only one of ``certfile`` and ``keyfile``, or a port outside 0..65535.
    OSError
        The address cannot be bound (in use, not local) or the certificate files
        cannot be read.
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
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.gateway = gateway
        context: ssl.SSLContext | None = None
        if certfile is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(certfile, keyfile)
        self.tls = context is not None
        self._sock = socket.create_server((host, port), backlog=256)
        self._host = host
        self._pool = ThreadPoolExecutor(
            max_workers=gateway.settings.workers, thread_name_prefix="bridge-worker"
        )
        self._protocol = _Protocol(gateway, context, self._pool)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="bridge-http", daemon=True
        )
        gateway.add_listener(
            lambda name: self._loop.call_soon_threadsafe(self._protocol.wake, name)
        )

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self._sock.getsockname()[0]
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        """Connections open now (for tests and status)."""
        return len(self._protocol.conns)

    def start(self) -> GatewayServer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(
                self._protocol.connection, sock=self._sock, limit=MAX_HEAD_BYTES
            ),
            self._loop,
        ).result()
        log.info("flowerbed bridge listening on %s", self.url)
        return self

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        conns = list(self._protocol.conns)
        for conn in conns:
            conn.writer.transport.abort()
            if conn.task is not None:
                conn.task.cancel()
        # Await them: a task left pending is reported at garbage collection.
        await asyncio.gather(
            *(c.task for c in conns if c.task is not None), return_exceptions=True
        )
        if self._server is not None:
            await self._server.wait_closed()

    def stop(self) -> None:
        """Stop serving, then stop the gateway's relays."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.gateway.stop()
