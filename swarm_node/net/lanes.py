"""Direct lanes: the bulk protocols over TLS connections of their own, beside libp2p.

Every byte between two libp2p peers goes through both p2pd daemons and one multiplexed
connection: about 110 MB/s on an H100 host's loopback, a fifth of what the GPU on each
side produces as activations. A lane is a TCP connection of its own between the two
Python processes, encrypted with TLS 1.3, that carries the same exchanges as a libp2p
stream (activations, outer payloads, state chunks); control messages stay on libp2p.

A lane is negotiated and authenticated over libp2p (caller A, server B):

1. A asks B on ``/swarm-node/lane/1.0.0``. libp2p authenticated B's peer id to A, and
   A's to B. B answers an offer: its lane port, the SHA-256 of its lane certificate (a
   key pair made at start, never written anywhere) and a ticket: random bytes that B
   ties to A's peer id for ``TICKET_TTL_S``.
2. A dials the IP its libp2p connection to B goes to (never an address B names: a lane
   cannot be pointed at a third host) at that port, handshakes TLS 1.3 and checks B's
   certificate against the offer's hash: the far end is the peer libp2p authenticated.
   On loopback (two processes of one machine) the lane is plain TCP (net/lane_io.py).
3. A sends ``LANE_HELLO`` and the ticket; B looks it up and from then on takes every
   request on the lane as A's (its bans, caps and faults are A's).
4. Each request: one byte of protocol-name length, the name, then exactly the exchange
   that protocol has on a libp2p stream (docs/PROTOCOL.md section 2). After the answer
   the lane carries the caller's next request.

A caller that cannot reach B's lane port (a NAT, a firewall) gives up within
``DIAL_TIMEOUT_S`` and uses libp2p streams to B for ``NO_LANE_S``: lanes only ever make
a path faster. Every table here is bounded."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import logging
import math
import secrets
import socket
import ssl
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarm_node.errors import PeerError, ProtocolError
from swarm_node.net import protocols
from swarm_node.net.identity import short_id
from swarm_node.net.lane_io import LaneIO, dial, handshake

log = logging.getLogger(__name__)

LANE_HELLO = b"swarm-node lane 1\n"
TICKET_BYTES = 32
TICKET_TTL_S = 600.0
MAX_TICKETS = 4096  # all callers together; the oldest go first
MAX_TICKETS_PER_PEER = 4
DIAL_TIMEOUT_S = 3.0  # TCP connect and TLS handshake: a lane is for links that answer at once
HELLO_TIMEOUT_S = 5.0  # the server's bound on the handshake and the ticket after accept
NO_LANE_S = 300.0  # after a failed dial, libp2p to that peer for this long
CALLER_IDLE_S = 30.0  # a caller drops a lane idle for longer (the server waits more: no race)
SERVER_IDLE_S = 90.0
MAX_LANES_PER_PEER = 4  # a caller's open lanes to one peer; more requests at once go over libp2p
MAX_INBOUND_PER_PEER = 8
MAX_INBOUND = 256  # connections, those still in their handshake included
MAX_INBOUND_PER_ADDRESS = 16  # one host's share: identities are free, addresses are not (loopback exempt)
OFFER_BYTES = 1024

# (caller's peer id, caller's address as /ip4/x/tcp/p, reader, writer) -> the lane may carry another request
LaneAnswer = Callable[[str, str, LaneIO, LaneIO], Awaitable[bool]]


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def _address_of(raw: socket.socket) -> str | None:
    """The remote IP of a connection, None for loopback (a swarm on one machine shares it)."""
    try:
        ip = raw.getpeername()[0]
    except OSError:
        return None
    return None if _is_loopback(ip) else ip


def lane_hosts(host_maddrs: Sequence[str]) -> list[str]:
    """The IPs the node's libp2p side listens on (/ip4|ip6/ADDR/tcp/PORT), where its
    lanes listen too: a node kept to loopback keeps its lanes there."""
    hosts = []
    for text in host_maddrs:
        parts = text.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and parts[1] not in hosts:
            hosts.append(parts[1])
    return hosts


@dataclass(frozen=True)
class Offer:
    """What a server told us over libp2p, with the IP we reached it at."""

    host: str
    port: int
    cert_sha256: bytes
    ticket: bytes
    expires_at: float

    def to_wire(self) -> bytes:
        return msgpack.packb({"port": self.port, "cert": self.cert_sha256, "ticket": self.ticket,
                              "ttl": TICKET_TTL_S})

    @classmethod
    def from_wire(cls, raw: bytes, host: str, now: float) -> Offer:
        try:
            m = msgpack.unpackb(raw, raw=True, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: a map keyed by a list
            raise ProtocolError(f"lane offer is not msgpack ({exc})") from None
        if not isinstance(m, dict):
            raise ProtocolError("lane offer is not a map")
        port, cert, ticket, ttl = m.get(b"port"), m.get(b"cert"), m.get(b"ticket"), m.get(b"ttl")
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(cert, bytes) and len(cert) == 32
                and isinstance(ticket, bytes) and len(ticket) == TICKET_BYTES
                and isinstance(ttl, int | float) and not isinstance(ttl, bool) and not math.isnan(ttl)):
            raise ProtocolError("lane offer has a bad port, certificate hash, ticket or lifetime")
        # its own word on the lifetime is believed only as far as ours goes
        return cls(host, port, cert, ticket, now + min(max(float(ttl), 0.0), TICKET_TTL_S) * 0.9)


class LaneIdentity:
    """The TLS key and self-signed certificate of this process's lanes. The certificate
    proves nothing by itself: its hash travels in the offer, over libp2p."""

    def __init__(self):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm-node lane")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=3650)).sign(key, hashes.SHA256()))
        self.cert_sha256 = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()
        self.server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_context.minimum_version = ssl.TLSVersion.TLSv1_3
        # ssl loads a chain from files only: a private directory, gone once loaded
        with tempfile.TemporaryDirectory(prefix="swarm-lane-") as folder:
            cert_path, key_path = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            key_path.touch(mode=0o600)
            key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
            self.server_context.load_cert_chain(cert_path, key_path)


def client_context() -> ssl.SSLContext:
    """TLS 1.3 with the certificate pinned by hash after the handshake (``check_pin``),
    not by a CA: the offer that came over libp2p is the trust anchor."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def check_pin(der: bytes, cert_sha256: bytes) -> None:
    if not secrets.compare_digest(hashlib.sha256(der).digest(), cert_sha256):
        raise PeerError("the lane's certificate is not the one its offer named")


class Tickets:
    """Tickets we handed out, each tied to the peer id libp2p authenticated when it asked."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._peer_of: dict[bytes, tuple[str, float]] = {}  # insertion order: oldest first
        self._of_peer: dict[str, deque[bytes]] = defaultdict(deque)

    def issue(self, peer: str) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        mine = self._of_peer[peer]
        while len(mine) >= MAX_TICKETS_PER_PEER:
            self._peer_of.pop(mine.popleft(), None)
        while len(self._peer_of) >= MAX_TICKETS:
            oldest = next(iter(self._peer_of))
            self._forget(oldest)
        self._peer_of[ticket] = (peer, self.clock() + TICKET_TTL_S)
        mine.append(ticket)
        return ticket

    def redeem(self, ticket: bytes) -> str | None:
        """The peer a ticket was given to, while it is good (a ticket opens several lanes)."""
        found = self._peer_of.get(ticket)
        if found is None:
            return None
        peer, expires_at = found
        if self.clock() > expires_at:
            self._forget(ticket)
            return None
        return peer

    def _forget(self, ticket: bytes) -> None:
        peer, _ = self._peer_of.pop(ticket)
        mine = self._of_peer[peer]
        if ticket in mine:
            mine.remove(ticket)
        if not mine:
            del self._of_peer[peer]


class LaneServer:
    """Accepts lanes, checks each one's ticket, and hands its requests to ``answer``."""

    def __init__(self, identity: LaneIdentity, tickets: Tickets,
                 answer_for: Callable[[str], LaneAnswer | None], on_fault: Callable[[str, str], None]):
        self.identity, self.tickets, self.answer_for, self.on_fault = identity, tickets, answer_for, on_fault
        self.port = 0
        self.requests = 0  # requests that came over a lane (to a protocol lanes carry)
        self._inbound: dict[str, int] = defaultdict(int)  # lanes open, by caller
        self._by_address: dict[str, int] = defaultdict(int)  # connections open, by remote IP (not loopback)
        self._listeners: list[socket.socket] = []
        self._accepting: set[asyncio.Task] = set()
        self._lanes: set[LaneIO] = set()

    async def start(self, hosts: Sequence[str], port: int) -> int:
        for host in hosts:
            listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                            backlog=64)
            listener.setblocking(False)
            self._listeners.append(listener)
            port = port or listener.getsockname()[1]  # every interface on the one port
            self._accepting.add(asyncio.create_task(self._accept(listener), name="lane-accept"))
        self.port = port
        return port

    async def close(self) -> None:
        tasks = list(self._accepting)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        for lane in list(self._lanes):
            lane.close()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                raw, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, say: the listener itself is fine
                log.debug("accepting a lane failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            # connections still in their handshake count too: each holds a thread
            address = _address_of(raw)
            if (len(self._accepting) - len(self._listeners) >= MAX_INBOUND
                    or (address is not None and self._by_address[address] >= MAX_INBOUND_PER_ADDRESS)):
                raw.close()
                continue
            task = asyncio.create_task(self._on_lane(raw, address), name="lane")
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    async def _on_lane(self, raw: socket.socket, address: str | None) -> None:
        peer = lane = None
        if address is not None:
            self._by_address[address] += 1
        try:
            lane = await handshake(raw, self.identity.server_context, HELLO_TIMEOUT_S, plain_ok=_is_loopback(
                raw.getpeername()[0]))
            self._lanes.add(lane)
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = await lane.readexactly(len(LANE_HELLO) + TICKET_BYTES)
            peer = self.tickets.redeem(hello[len(LANE_HELLO):]) if hello.startswith(LANE_HELLO) else None
            if peer is None or self._inbound[peer] >= MAX_INBOUND_PER_PEER:
                return  # an unknown or stale ticket proves nothing about who sent it: nobody to blame
            self._inbound[peer] += 1
            ip, port = lane.get_extra_info("peername")[:2]
            address = f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"
            while await self._serve_one(peer, address, lane):
                pass
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError):
            pass
        finally:
            if peer is not None and self._inbound.get(peer):
                self._inbound[peer] -= 1
                if not self._inbound[peer]:
                    del self._inbound[peer]
            if lane is not None:
                self._lanes.discard(lane)
                lane.close()
            if address is not None:
                self._by_address[address] -= 1
                if not self._by_address[address]:
                    del self._by_address[address]

    async def _serve_one(self, peer: str, address: str, lane: LaneIO) -> bool:
        async with asyncio.timeout(SERVER_IDLE_S):
            head = await lane.read(1)
        if not head:
            return False  # the caller closed it
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            name = (await lane.readexactly(head[0])).decode("ascii", errors="replace")
        answer = self.answer_for(name)
        if answer is None:  # a bulk protocol we stopped serving (shutting down) is nobody's fault
            if name not in protocols.BULK:
                self.on_fault(peer, f"asked for {name!r} on a lane, which does not carry it")
            return False
        self.requests += 1
        return await answer(peer, address, lane, lane)


@dataclass
class Lane:
    io: LaneIO  # reader and writer both
    address: str  # the server's, as /ip4/x/tcp/p (for pacing)
    idle_since: float = 0.0

    @property
    def reader(self) -> LaneIO:
        return self.io

    @property
    def writer(self) -> LaneIO:
        return self.io

    def usable(self, now: float) -> bool:
        return not self.io.is_closing() and now - self.idle_since < CALLER_IDLE_S

    def close(self) -> None:
        self.io.close()


class LanePool:
    """The caller's side: open lanes by peer, offers by peer, and peers we could not
    reach directly. ``ask_offer(peer, timeout_s)`` returns (offer bytes, the IP our
    libp2p connection to it goes to, or None for a relayed connection)."""

    def __init__(self, ask_offer: Callable[[str, float], Awaitable[tuple[bytes, str | None]]],
                 clock: Callable[[], float] = time.monotonic, encrypt_loopback: bool = False):
        self.ask_offer = ask_offer
        self.clock = clock
        self.encrypt_loopback = encrypt_loopback  # tests: the TLS path on one machine
        self.context = client_context()
        self.lanes_opened = 0
        self._idle: dict[str, list[Lane]] = defaultdict(list)
        self._open: dict[str, int] = defaultdict(int)
        self._offers: dict[str, Offer] = {}
        self._no_lane_until: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._closed = False

    def direct_to(self, peer: str) -> bool:
        return self._no_lane_until.get(peer, 0.0) <= self.clock()

    async def take(self, peer: str, timeout_s: float) -> Lane | None:
        """An idle lane to ``peer``, or a new one; None: use libp2p for this request."""
        now = self.clock()
        if self._closed or not self.direct_to(peer):
            return None
        idle = self._idle.get(peer)
        while idle:
            lane = idle.pop()
            if lane.usable(now):
                return lane
            self._drop(peer, lane)
        if self._open[peer] >= MAX_LANES_PER_PEER:
            return None
        self._open[peer] += 1
        try:
            lane = await self._dial(peer, min(timeout_s, DIAL_TIMEOUT_S + 2.0))
        except BaseException:
            self._open[peer] -= 1
            raise
        if lane is None:
            self._open[peer] -= 1
        return lane

    def give_back(self, peer: str, lane: Lane) -> None:
        if self._closed or lane.io.is_closing():
            self._drop(peer, lane)
            return
        lane.idle_since = self.clock()
        self._idle[peer].append(lane)

    def discard(self, peer: str, lane: Lane) -> None:
        self._drop(peer, lane)

    def close(self) -> None:
        self._closed = True
        for peer, lanes in list(self._idle.items()):
            for lane in lanes:
                self._drop(peer, lane)
        self._idle.clear()

    def _drop(self, peer: str, lane: Lane) -> None:
        lane.close()
        self._open[peer] = max(0, self._open[peer] - 1)
        if not self._open[peer]:
            self._open.pop(peer, None)

    async def _dial(self, peer: str, timeout_s: float) -> Lane | None:
        try:
            async with asyncio.timeout(timeout_s):
                offer = await self._offer(peer, timeout_s)
                if offer is None:
                    return None
                tls = self.encrypt_loopback or not _is_loopback(offer.host)
                io, der = await dial(offer.host, offer.port, self.context if tls else None, DIAL_TIMEOUT_S)
                try:
                    if tls:
                        check_pin(der, offer.cert_sha256)
                    io.write(LANE_HELLO + offer.ticket)
                except BaseException:
                    io.close()
                    raise
        except (TimeoutError, ConnectionError, OSError, ssl.SSLError, PeerError) as exc:
            self._no_lane(peer, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return None
        self.lanes_opened += 1
        host = offer.host
        return Lane(io, f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{offer.port}", self.clock())

    async def _offer(self, peer: str, timeout_s: float) -> Offer | None:
        async with self._locks[peer]:
            offer = self._offers.get(peer)
            if offer is not None and offer.expires_at > self.clock():
                return offer
            self._offers.pop(peer, None)
            raw, host = await self.ask_offer(peer, timeout_s)
            if host is None:
                self._no_lane(peer, "our libp2p connection to it is relayed")
                return None
            offer = self._offers[peer] = Offer.from_wire(raw, host, self.clock())
            while len(self._offers) > MAX_TICKETS:
                self._offers.pop(next(iter(self._offers)))
            return offer

    def _no_lane(self, peer: str, why: str) -> None:
        if peer not in self._no_lane_until:
            log.info("no direct lane to %s (%s): its bulk transfers go over libp2p", short_id(peer), why)
        self._no_lane_until[peer] = self.clock() + NO_LANE_S
        self._offers.pop(peer, None)
        while len(self._no_lane_until) > MAX_TICKETS:
            self._no_lane_until.pop(next(iter(self._no_lane_until)))
