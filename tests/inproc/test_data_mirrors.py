"""HTTP(S) mirrors of a prepared dataset (the security review's L1): a mirror is read
where it is (no redirects), at a public address unless the node allows private ones, with
one deadline per request, and only with ranges (a mirror that ignores them is refused
rather than sending every chunk's preceding bytes again)."""

from __future__ import annotations

import asyncio
import functools
import http.server
import socket
import threading
import time
from pathlib import Path

import pytest
import vclock
from data_parts import FakeNet, fetcher, prepared_host, serving

from swarm_node.data.mirror import http_range
from swarm_node.errors import PeerError


@pytest.fixture(scope="module")
def host_folder(tmp_path_factory):
    return prepared_host(tmp_path_factory)


class _Recording(http.server.SimpleHTTPRequestHandler):
    """A plain file server (it ignores ranges) that notes each request it gets."""
    seen: list[str]

    def do_GET(self):
        self.seen.append(self.path)
        super().do_GET()

    def log_message(self, *args):
        pass


class _Redirecting(_Recording):
    target: str

    def do_GET(self):
        self.seen.append(self.path)
        self.send_response(302)
        self.send_header("Location", self.target)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _LongRanges(_Recording):
    """Answers a range with 206 and every byte from its start to the end of the file."""

    def do_GET(self):
        self.seen.append(self.path)
        data = Path(self.translate_path(self.path)).read_bytes()
        start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])


def _server(handler, directory: Path, **attrs):
    seen: list[str] = []
    cls = type("Handler", (handler,), {"seen": seen, **attrs})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(cls, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", seen


def _with_mirror(tmp_path, host_folder, url: str, **options):
    """A fetcher that has the manifest and no peer: the mirror ``url`` is all there is."""
    folder, _, digest = host_folder
    net = FakeNet()
    net.handlers["QmBoot"] = serving(folder, digest).handle
    f = fetcher(tmp_path, digest, net, **options)
    asyncio.run(f.fetch_manifest())
    object.__setattr__(f.cache.manifest, "sources", (url,))
    net.handlers.clear()
    return f


def _fetch(f, entry, timeout_s: float) -> bool:
    """Whether ``entry`` arrived within ``timeout_s``."""
    async def run():
        try:
            await asyncio.wait_for(f.fetch(entry), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            await f.close()
    return vclock.run(run())  # waits for no source are virtual


def test_a_mirror_that_redirects_is_refused_and_the_redirect_not_followed(tmp_path, host_folder):
    folder, manifest, _ = host_folder
    probe, probe_url, probed = _server(_Recording, folder)
    redirecting, url, _ = _server(_Redirecting, folder.parent, target=f"{probe_url}/{manifest.train[2].name}")
    try:
        f = _with_mirror(tmp_path, host_folder, f"{url}/{folder.name}", private_mirrors=True)
        assert not _fetch(f, manifest.train[2], 3.0)
        assert probed == [] and f.stats.refused == {f"{url}/{folder.name}"}
    finally:
        for server in (probe, redirecting):
            server.shutdown()
            server.server_close()


def test_a_mirror_at_a_private_address_is_read_only_when_allowed(tmp_path, host_folder):
    folder, manifest, _ = host_folder
    server, url, seen = _server(_LongRanges, folder.parent)
    try:
        f = _with_mirror(tmp_path, host_folder, f"{url}/{folder.name}")
        assert not _fetch(f, manifest.train[2], 3.0)
        assert seen == [] and f.stats.refused == {f"{url}/{folder.name}"}
        allowed = _with_mirror(tmp_path / "allowed", host_folder, f"{url}/{folder.name}",
                               private_mirrors=True)
        assert _fetch(allowed, manifest.train[2], 10.0)  # a 206 longer than the chunk: read no further
        assert allowed.stats.refused == set()
    finally:
        server.shutdown()
        server.server_close()


def test_a_mirror_that_ignores_ranges_is_refused_after_its_first_chunk(tmp_path, host_folder):
    folder, manifest, _ = host_folder
    server, url, seen = _server(_Recording, folder.parent)
    try:
        f = _with_mirror(tmp_path, host_folder, f"{url}/{folder.name}", private_mirrors=True)
        assert not _fetch(f, manifest.train[2], 3.0)
        assert len(seen) == 2 and f.stats.refused == {f"{url}/{folder.name}"}
    finally:
        server.shutdown()
        server.server_close()


def test_a_mirror_that_sends_a_byte_at_a_time_meets_one_deadline():
    """Each socket read has a time-out too, but the request as a whole has one: a
    mirror that sends a byte every 0.2 s cannot hold a thread past it."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def dribble():
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-16383/16384\r\n"
                         b"Content-Length: 16384\r\n\r\n")
            while not stop.is_set():
                try:
                    conn.sendall(b"x")
                except OSError:
                    return
                stop.wait(0.2)

    threading.Thread(target=dribble, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(PeerError):
            http_range(f"http://127.0.0.1:{listener.getsockname()[1]}/data", "shard", 0, 16384, timeout_s=1.0,
                       private_ok=True)
        assert time.monotonic() - started < 3.0
    finally:
        stop.set()
        listener.close()
