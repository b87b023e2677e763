"""Reading a chunk from an HTTP(S) mirror of a prepared dataset (the manifest's
``sources``), as carefully as a request into someone else's network should be made:

- the mirror's name is resolved once and the connection goes to that address, which
  must be a public one (loopback, private, link-local and reserved ones only when the
  node is told so: ``--data-private-mirrors``); redirects are not followed;
- the whole request has one deadline, however slowly the mirror sends;
- the answer must hold the range asked for (206, its Content-Range from the chunk's
  first byte to its last or beyond), read no further than the chunk; or, for the first
  chunk only, the whole file (200), read no further either: a mirror that ignores
  ranges would send every chunk's preceding bytes again, so it is refused."""

from __future__ import annotations

import http.client
import ipaddress
import re
import socket
import ssl
import time
from urllib.parse import quote, urlsplit

from swarm_node.errors import PeerError, ProtocolError

READ_BYTES = 64 << 10
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class MirrorRefused(ProtocolError):
    """The mirror cannot be used for this run (its address, its redirects, its ranges)."""


def check_mirror_url(url: str) -> None:
    """A base URL the fetcher may append ``/<name>`` to; MirrorRefused otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MirrorRefused(f"{url}: not an http(s) URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise MirrorRefused(f"{url}: a mirror's URL has no query, fragment or user")
    try:
        _ = parts.port  # parsed when read
    except ValueError:
        raise MirrorRefused(f"{url}: bad port") from None


def http_range(url: str, name: str, start: int, end: int, *, timeout_s: float,
               private_ok: bool = False) -> bytes | None:
    """Bytes [start, end) of file ``name`` under the mirror ``url``; None when the mirror
    does not have them. PeerError when it fails now, MirrorRefused when it never can."""
    check_mirror_url(url)
    deadline = time.monotonic() + timeout_s
    parts = urlsplit(url)
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    address = _address(parts.hostname, port, private_ok)
    path = f"{parts.path.rstrip('/')}/{quote(name)}"
    conn = _Connection(address, parts.hostname, port, https, _left(deadline))
    try:
        conn.request("GET", path,
                     headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        sock = conn.sock  # the connection lets go of it once the answer says it closes
        response = conn.getresponse()
        if 300 <= response.status < 400:
            raise MirrorRefused(
                f"{url} answered {response.status} (a redirect): mirrors are read where they are"
            )
        if response.status == 206:
            found = CONTENT_RANGE.fullmatch(response.getheader("Content-Range", "").strip())
            if not found or int(found.group(1)) != start or int(found.group(2)) < end - 1:
                raise MirrorRefused(f"{url}/{name} answered another range than bytes {start}-{end - 1}")
            return _read(sock, response, end - start, deadline)
        if response.status == 200:
            if start != 0:
                raise MirrorRefused(f"{url} does not honour Range requests")
            return _read(sock, response, end, deadline)
        return None
    except (OSError, http.client.HTTPException, ssl.SSLError) as exc:  # timeouts, resets, cut bodies
        raise PeerError(f"{url}/{name}: {exc}") from None
    finally:
        conn.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the mirror's deadline passed")
    return left


def _read(sock: socket.socket, response: http.client.HTTPResponse, nbytes: int, deadline: float) -> bytes:
    """Exactly ``nbytes`` of the body, each socket read bounded by what is left of the deadline."""
    got = bytearray()
    while len(got) < nbytes:
        sock.settimeout(_left(deadline))
        piece = response.read1(min(READ_BYTES, nbytes - len(got)))
        if not piece:
            raise http.client.IncompleteRead(bytes(got), nbytes - len(got))
        got += piece
    return bytes(got)


def _address(host: str, port: int, private_ok: bool) -> str:
    """The address to connect to: the first the name resolves to, if public."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PeerError(f"{host}: {exc}") from None
    for *_, sockaddr in found:
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if private_ok or ip.is_global:
            return str(ip)
    raise MirrorRefused(f"{host} is not at a public address (pass --data-private-mirrors to allow one)")


class _Connection(http.client.HTTPSConnection):
    """An HTTP(S) connection to ``address`` for ``host``: the name is checked in the
    certificate and sent as Host, but never resolved again."""

    def __init__(self, address: str, host: str, port: int, https: bool, timeout_s: float):
        super().__init__(host, port, timeout=timeout_s,
                         context=ssl.create_default_context() if https else None)
        self._address, self._https = address, https

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)
        if self._https:
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)
