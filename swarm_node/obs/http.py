"""A small HTTP/1.1 server for status endpoints (the bootstrap's dashboard, a node's
/healthz and /metrics): GET and HEAD only, one request per connection, capped request
size, connection count and time. The standard library's http.server is thread-based;
this stays on the process's single event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           503: "Service Unavailable"}


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[], Response]


class StatusServer:
    def __init__(self, routes: dict[str, Route]):
        self.routes = routes
        self._server: asyncio.Server | None = None
        self._gate = asyncio.Semaphore(MAX_CONNECTIONS)

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._gate.locked():
            writer.close()
            return
        async with self._gate:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    method, path = await _read_request(reader)
                    response = self._route(method, path)
                    await _write_response(writer, response, head_only=method == "HEAD")
            except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError,
                    asyncio.IncompleteReadError):
                pass  # a slow or malformed client gets its connection closed
            finally:
                writer.close()

    def _route(self, method: str, path: str) -> Response:
        if method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD\n")
        route = self.routes.get(path.split("?", 1)[0])
        if route is None:
            return Response(404, f"not found; try {', '.join(sorted(self.routes))}\n".encode())
        return route()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    head = await reader.readuntil(b"\r\n\r\n")  # bounded by the stream limit
    request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("bad request line")
    return parts[0], parts[1]


async def _write_response(writer: asyncio.StreamWriter, response: Response, head_only: bool) -> None:
    headers = (f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Unknown')}\r\n"
               f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
               "Cache-Control: no-store\r\nConnection: close\r\n\r\n")
    writer.write(headers.encode("latin-1"))
    if not head_only:
        writer.write(response.body)
    await writer.drain()
