"""A small Python phone speaking the phone protocol, for tests and scale checks.

It does what ``android_client/core``'s Java client does on the wire (hello, long
poll, ranged download, chunked upload, complete/fail) with ``http.client`` only, so
a hundred of them fit in one process as threads.
"""

from __future__ import annotations

import http.client
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from flowerbed.clients.bridge.codec import decode_tensors, encode_tensors


@dataclass
class Response:
    """Status, headers and body of one gateway answer."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))


class SimPhone:
    """One simulated phone (one keep-alive connection to the gateway).

    Parameters
    ----------
    url : str
        Gateway base URL, e.g. ``http://127.0.0.1:8470``.
    token : str
        The phone's bearer token.
    timeout : float
        Socket timeout in seconds (must exceed the long-poll wait).
    ssl_context : ssl.SSLContext | None
        For an HTTPS gateway.
    """

    def __init__(
        self,
        url: str,
        token: str,
        timeout: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(url)
        self.token = token
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._https = parts.scheme == "https"
        self._timeout = timeout
        self._ssl = ssl_context
        self._conn: http.client.HTTPConnection | None = None
        self.node_id: int | None = None
        self.chunk_bytes = 0

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=self._ssl
                )
            else:
                self._conn = http.client.HTTPConnection(
                    self._host, self._port, timeout=self._timeout
                )
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """Send one request (with this phone's token) and read the whole answer."""
        all_headers = {"Authorization": f"Bearer {self.token}"}
        if body is not None:
            all_headers["Content-Length"] = str(len(body))
        all_headers.update(headers or {})
        conn = self._connection()
        try:
            conn.request(method, path, body=body, headers=all_headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if resp.getheader("Connection", "").lower() == "close":
            self.close()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)

    def post_json(self, path: str, payload: Any) -> Response:
        return self.request(
            "POST",
            path,
            json.dumps(payload).encode("utf-8"),
            {"Content-Type": "application/json"},
        )

    # -- protocol steps -------------------------------------------------------------
    def hello(
        self, device: dict[str, Any] | None = None, protocols: tuple[int, ...] = (1,)
    ) -> dict[str, Any]:
        """Say hello speaking ``protocols`` (revision 1 only by default)."""
        body: dict[str, Any] = {"protocol": max(protocols), "device": device or {}}
        if protocols != (1,):
            body["protocols"] = list(protocols)
        resp = self.post_json("/v1/hello", body)
        if resp.status != 200:
            raise RuntimeError(f"hello answered {resp.status}: {resp.body!r}")
        info: dict[str, Any] = resp.json()
        self.node_id = int(info["node_id"])
        self.chunk_bytes = int(info["chunk_bytes"])
        return info

    def poll(self, wait_s: float) -> dict[str, Any] | None:
        resp = self.request("GET", f"/v1/task?wait={wait_s:g}")
        if resp.status == 204:
            return None
        if resp.status != 200:
            raise RuntimeError(f"poll answered {resp.status}: {resp.body!r}")
        task: dict[str, Any] = resp.json()
        return task

    def download(self, task_id: str) -> list[tuple[str, np.ndarray]]:
        resp = self.request("GET", f"/v1/task/{task_id}/arrays")
        if resp.status != 200:
            raise RuntimeError(f"download answered {resp.status}: {resp.body!r}")
        return decode_tensors(resp.body)

    def upload(self, task_id: str, tensors: list[tuple[str, np.ndarray]]) -> None:
        blob = encode_tensors(tensors)
        offset = 0
        while offset < len(blob):
            chunk = blob[offset : offset + self.chunk_bytes]
            resp = self.request(
                "PUT",
                f"/v1/task/{task_id}/result?offset={offset}&total={len(blob)}",
                chunk,
                {"Content-Type": "application/x-flowerbed-tensors"},
            )
            if resp.status == 409:
                offset = int(resp.json()["received"])
                continue
            if resp.status != 200:
                raise RuntimeError(f"upload answered {resp.status}: {resp.body!r}")
            offset = int(resp.json()["received"])

    def complete(self, task_id: str, metrics: dict[str, float]) -> Response:
        return self.post_json(f"/v1/task/{task_id}/complete", {"metrics": metrics})

    def fail(self, task_id: str, reason: str) -> Response:
        return self.post_json(f"/v1/task/{task_id}/fail", {"reason": reason})
