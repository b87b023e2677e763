"""Direct lanes: the bulk protocols over TLS connections of their own, beside libp2p.

Every byte between two libp2p peers goes through both p2pd daemons and one multiplexed
connection: about 110 MB/s on an H100 host's loopback, a fifth of what the GPU on each
side produces as activations. A lane is a TCP connection of its own between the two
Python processes, encrypted with TLS 1.3, that carries the same exchanges as a libp2p
stream (activations, outer payloads, state chunks); control messages stay on libp2p.

A lane is negotiated and authenticated over libp2p (caller A, server B):

1. A asks B on ``/swarm-node/lane/2.0.0``. libp2p authenticated B's peer id to A, and
   A's to B. B answers an offer (only to a peer it admits): its lane port, the SHA-256
   of its lane certificate (a key pair made at start, never written anywhere) and a
   ticket: a secret B ties to A's peer id for ``TICKET_TTL_S`` (net/lane_auth.py).
2. A dials the IP its libp2p connection to B goes to (never an address B names: a lane
   cannot be pointed at a third host) at that port, handshakes TLS 1.3 and checks B's
   certificate against the offer's hash: the far end is the peer libp2p authenticated.
   On loopback (two processes of one machine) the lane is plain TCP (net/lane_io.py).
3. The ticket opens the lane: A names it by its hash with a challenge, B answers
   refused, or accepted with a proof that it holds the ticket (so on plain TCP too, A
   writes nothing that matters before the far end is proven), and A answers B's own
   challenge. From then on B takes every request on the lane as A's (its bans, caps and
   faults are A's). A refused ticket (B forgot it, or restarted) costs A one request,
   sent over libp2p; the next asks for a new offer.
4. Each request: one byte of protocol-name length, the name, then exactly the exchange
   that protocol has on a libp2p stream (docs/PROTOCOL.md section 2). After the answer
   the lane carries the caller's next request.

A caller that cannot reach B's lane port (a NAT, a firewall) gives up within
``DIAL_TIMEOUT_S`` and uses libp2p streams to B for ``NO_LANE_S``: lanes only ever make
a path faster. Every table here is bounded."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from swarm_node.errors import PeerError
from swarm_node.net import protocols
from swarm_node.net.addresses import LOOPBACK, address_key, parse_ip
from swarm_node.net.identity import short_id
from swarm_node.net.lane_auth import (  # the names other modules know lanes by, too
    ACCEPTED,
    CHALLENGE_BYTES,
    HELLO_BYTES,
    LANE_HELLO,
    MAX_TICKETS,
    MAX_TICKETS_PER_PEER,
    PROOF_BYTES,
    REFUSED,
    TICKET_BYTES,
    TICKET_TTL_S,
    LaneIdentity,
    LaneRefused,
    Offer,
    Tickets,
    caller_proof,
    check_pin,
    client_context,
    open_lane,
    server_proof,
)
from swarm_node.net.lane_io import LaneIO, dial, handshake

__all__ = ["LANE_HELLO", "MAX_TICKETS", "MAX_TICKETS_PER_PEER", "TICKET_BYTES", "TICKET_TTL_S", "Lane",
           "LaneAnswer", "LaneIdentity", "LanePool", "LaneServer", "Offer", "Tickets", "lane_hosts"]

log = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0  # TCP connect and TLS handshake: a lane is for links that answer at once
HELLO_TIMEOUT_S = 5.0  # the server's bound on the handshake and the ticket's proofs after accept
NO_LANE_S = 300.0  # after a failed dial, libp2p to that peer for this long
CALLER_IDLE_S = 30.0  # a caller drops a lane idle for longer (the server waits more: no race)
SERVER_IDLE_S = 90.0
MAX_LANES_PER_PEER = 4  # a caller's open lanes to one peer; more requests at once go over libp2p
MAX_INBOUND_PER_PEER = 8
MAX_INBOUND = 256  # connections, those still in their handshake included
MAX_INBOUND_PER_ADDRESS = 16  # one host's share (an IPv6 /64's): identities are free, addresses are not
# Every process of this machine, and whoever a local tunnel or proxy lets in: at most half,
# so that callers reaching us at their own addresses keep the other half. A swarm of up to
# 33 nodes on one machine fits (4 lanes from each other node).
MAX_INBOUND_LOOPBACK = MAX_INBOUND // 2
OFFER_BYTES = 1024
MAX_PEERS = MAX_TICKETS  # the caller's tables by peer (offers, peers without lanes)

# (caller's peer id, caller's address as /ip4/x/tcp/p, reader, writer) -> the lane may carry another request
LaneAnswer = Callable[[str, str, LaneIO, LaneIO], Awaitable[bool]]


def _is_loopback(ip: str) -> bool:
    parsed = parse_ip(ip)
    return parsed is not None and parsed.is_loopback


def _address_of(raw: socket.socket) -> str | None:
    """The key per-address caps count a connection under (net/addresses.py)."""
    try:
        return address_key(raw.getpeername()[0])
    except OSError:
        return None


def lane_hosts(host_maddrs: Sequence[str]) -> list[str]:
    """The IPs the node's libp2p side listens on (/ip4|ip6/ADDR/tcp/PORT), where its
    lanes listen too: a node kept to loopback keeps its lanes there."""
    hosts = []
    for text in host_maddrs:
        parts = text.strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and parts[1] not in hosts:
            hosts.append(parts[1])
    return hosts


class LaneServer:
    """Accepts lanes, opens each one with its ticket, and hands its requests to ``answer``.
    ``admit(peer)``: whether the ticket's holder may still use it (not banned since)."""

    def __init__(self, identity: LaneIdentity, tickets: Tickets,
                 answer_for: Callable[[str], LaneAnswer | None], on_fault: Callable[[str, str], None],
                 admit: Callable[[str], bool] = lambda peer: True):
        self.identity, self.tickets, self.answer_for, self.on_fault = identity, tickets, answer_for, on_fault
        self.admit = admit
        self.port = 0
        self.requests = 0  # requests that came over a lane (to a protocol lanes carry)
        self._inbound: dict[str, int] = {}  # lanes open, by caller
        self._by_address: dict[str, int] = {}  # connections open, by address key (net/addresses.py)
        self._listeners: list[socket.socket] = []
        self._accepting: set[asyncio.Task] = set()
        self._lanes: set[LaneIO] = set()

    async def start(self, hosts: Sequence[str], port: int) -> int:
        for host in hosts:
            listener = socket.create_server((host, port),
                                            family=socket.AF_INET6 if ":" in host else socket.AF_INET,
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
        self.port = 0  # no more offers of it

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
            where = _address_of(raw)
            cap = MAX_INBOUND_LOOPBACK if where == LOOPBACK else MAX_INBOUND_PER_ADDRESS
            if (len(self._accepting) - len(self._listeners) >= MAX_INBOUND
                    or (where is not None and self._by_address.get(where, 0) >= cap)):
                raw.close()
                continue
            task = asyncio.create_task(self._on_lane(raw, where), name="lane")
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    async def _on_lane(self, raw: socket.socket, where: str | None) -> None:
        """``where``: the address key the connection is counted under, until it ends."""
        peer = lane = None
        _count(self._by_address, where, +1)
        try:
            lane = await handshake(raw, self.identity.server_context, HELLO_TIMEOUT_S, plain_ok=_is_loopback(
                raw.getpeername()[0]))
            self._lanes.add(lane)
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                peer = await self._open(lane)
            if peer is None:
                return  # an unknown or stale ticket proves nothing about who sent it: nobody to blame
            ip, port = lane.get_extra_info("peername")[:2]
            caller = f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"
            while await self._serve_one(peer, caller, lane):
                pass
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError):
            pass
        finally:
            if peer is not None:
                _count(self._inbound, peer, -1)
            if lane is not None:
                self._lanes.discard(lane)
                lane.close()
            _count(self._by_address, where, -1)

    async def _open(self, lane: LaneIO) -> str | None:
        """The peer whose ticket opens the lane, counted among its lanes; None when it is
        refused (told so: its caller then goes over libp2p at once). We prove we hold the
        ticket before the caller proves it does: it writes nothing before that."""
        first = await lane.readexactly(HELLO_BYTES)
        found = self.tickets.find(first[-32:]) if first.startswith(LANE_HELLO) else None
        if (found is None or not self.admit(found[0])
                or self._inbound.get(found[0], 0) >= MAX_INBOUND_PER_PEER):
            lane.write(REFUSED)
            await lane.drain()
            return None
        peer, ticket = found
        _count(self._inbound, peer, +1)
        try:
            challenge = secrets.token_bytes(CHALLENGE_BYTES)
            theirs = first[len(LANE_HELLO):len(LANE_HELLO) + CHALLENGE_BYTES]
            lane.write(ACCEPTED + server_proof(ticket, theirs, self.port) + challenge)
            proof = await lane.readexactly(PROOF_BYTES)
            if not secrets.compare_digest(proof, caller_proof(ticket, challenge)):
                raise ConnectionRefusedError("the caller does not hold the ticket it named")
        except BaseException:
            _count(self._inbound, peer, -1)
            raise
        return peer

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


def _count(table: dict[str, int], key: str | None, step: int) -> None:
    """A count by key that keeps no key at zero (a table of everyone ever seen grows)."""
    if key is None:
        return
    left = table.get(key, 0) + step
    if left > 0:
        table[key] = left
    else:
        table.pop(key, None)


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
        """Open, not idle too long, and nothing to read: an idle lane the server closed
        (it restarted, or went away) reads as its end, and would lose the next request."""
        return (not self.io.is_closing() and now - self.idle_since < CALLER_IDLE_S
                and not self.io.readable_within(0.0))

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
        self.refused = 0  # lanes whose server refused our ticket (the request went over libp2p)
        self._idle: dict[str, list[Lane]] = {}
        self._open: dict[str, int] = {}
        self._offers: dict[str, Offer] = {}
        self._no_lane_until: dict[str, float] = {}
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # by peer, while someone asks it
        self._swept_at = clock()
        self._closed = False

    def direct_to(self, peer: str) -> bool:
        return self._no_lane_until.get(peer, 0.0) <= self.clock()

    async def take(self, peer: str, timeout_s: float) -> Lane | None:
        """An idle lane to ``peer``, or a new one; None: use libp2p for this request."""
        now = self.clock()
        if self._closed or not self.direct_to(peer):
            return None
        self._sweep(now)
        idle = self._idle.get(peer, [])
        while idle:
            lane = idle.pop()
            if not idle:
                del self._idle[peer]
            if lane.usable(now):
                return lane
            self._drop(peer, lane)
        if self._open.get(peer, 0) >= MAX_LANES_PER_PEER:
            return None
        _count(self._open, peer, +1)
        lane = None
        try:
            lane = await self._dial(peer, min(timeout_s, DIAL_TIMEOUT_S + 2.0))
        finally:
            if lane is None:
                _count(self._open, peer, -1)
        return lane

    def give_back(self, peer: str, lane: Lane) -> None:
        if self._closed or lane.io.is_closing():
            self._drop(peer, lane)
            return
        lane.idle_since = self.clock()
        self._idle.setdefault(peer, []).append(lane)
        self._sweep(lane.idle_since)

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
        _count(self._open, peer, -1)

    def _sweep(self, now: float) -> None:
        """Closes lanes idle too long to peers we no longer call (each holds a socket and
        a thread), once every ``CALLER_IDLE_S``."""
        if now - self._swept_at < CALLER_IDLE_S:
            return
        self._swept_at = now
        for peer, lanes in list(self._idle.items()):
            keep = []
            for lane in lanes:
                if now - lane.idle_since < CALLER_IDLE_S and not lane.io.is_closing():
                    keep.append(lane)
                else:
                    self._drop(peer, lane)
            if keep:
                self._idle[peer] = keep
            else:
                del self._idle[peer]

    async def _dial(self, peer: str, timeout_s: float) -> Lane | None:
        """A new lane, or None. An opening that fails on an offer we had kept (its server
        restarted, forgot our ticket, or its port is someone else's now) costs only this
        request, sent over libp2p: the next asks for a new offer. One that fails on an
        offer asked for just now means libp2p to that peer for ``NO_LANE_S``."""
        fresh = True
        try:
            async with asyncio.timeout(timeout_s):
                offer, fresh = await self._offer(peer, timeout_s)
                if offer is None:
                    return None
                tls = self.encrypt_loopback or not _is_loopback(offer.host)
                io, der = await dial(offer.host, offer.port, self.context if tls else None, DIAL_TIMEOUT_S)
                try:
                    if tls:
                        check_pin(der, offer.cert_sha256)
                    await open_lane(io, offer)
                except BaseException:
                    io.close()
                    raise
        except (TimeoutError, ConnectionError, OSError, ssl.SSLError, EOFError, PeerError) as exc:
            if isinstance(exc, LaneRefused):
                self.refused += 1
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._offers.pop(peer, None)
            if fresh:
                self._no_lane(peer, why)
            else:
                log.debug("a kept lane offer of %s failed (%s): asking for a new one", short_id(peer), why)
            return None
        self.lanes_opened += 1
        host = offer.host
        return Lane(io, f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{offer.port}", self.clock())

    async def _offer(self, peer: str, timeout_s: float) -> tuple[Offer | None, bool]:
        """(the peer's offer, whether we asked for it just now)."""
        lock, users = self._locks.setdefault(peer, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                offer = self._offers.get(peer)
                if offer is not None and offer.expires_at > self.clock():
                    return offer, False
                self._offers.pop(peer, None)
                raw, host = await self.ask_offer(peer, timeout_s)
                if host is None:
                    self._no_lane(peer, "our libp2p connection to it is relayed")
                    return None, True
                offer = self._offers[peer] = Offer.from_wire(raw, host, self.clock())
                while len(self._offers) > MAX_PEERS:
                    self._offers.pop(next(iter(self._offers)))
                return offer, True
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[peer]

    def _no_lane(self, peer: str, why: str) -> None:
        if peer not in self._no_lane_until:
            log.info("no direct lane to %s (%s): its bulk transfers go over libp2p", short_id(peer), why)
        self._no_lane_until[peer] = self.clock() + NO_LANE_S
        self._offers.pop(peer, None)
        while len(self._no_lane_until) > MAX_PEERS:
            self._no_lane_until.pop(next(iter(self._no_lane_until)))

