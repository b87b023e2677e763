"""Request/response over libp2p binary streams: one stream per call, one
length-prefixed frame each way.

    frame := u64 length (big endian) | bytes

An empty answer frame means "busy" (the server is at its stream cap): the caller gets
PeerRefused and tries another peer without banning this one. The server reads (and
discards) the request before it answers busy: a handler that closes its stream with
request bytes still unread makes p2pd reset the stream, and the reset can overtake the
busy frame, turning a polite refusal into "stream closed mid-frame" at the caller.

The caller owns the deadline of every call; the server caps the request size before
reading it, the number of concurrent streams overall and per peer, and the time a
handler may take. Peer ids passed around are base58 strings (authenticated by the
libp2p handshake)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from swarm_node.errors import Oversize, PeerError, PeerRefused, PeerTimeout, ProtocolError, StreamClosed
from swarm_node.net import protocols
from swarm_node.net.addresses import LOOPBACK, address_key
from swarm_node.net.identity import short_id  # components import it from here too
from swarm_node.net.lanes import (
    OFFER_BYTES,
    Lane,
    LaneAnswer,
    LaneIdentity,
    LanePool,
    LaneServer,
    Offer,
    Tickets,
)
from swarm_node.net.pacing import BlockingPipe, Pacer, read_paced, send_paced
from swarm_node.net.refusals import Refusals

log = logging.getLogger(__name__)

LENGTH_BYTES = 8
DISCARD_CHUNK_BYTES = 64 << 10
LINGER_S = 2.0  # after answering, how long we wait for the caller to close first (plus the answer's transit)
# An answer handed to the daemon may still be on its way: a slow uplink moves a big one
# at no less than this (1 Mbit/s), and the caller closes only once it has read it all.
MIN_ANSWER_BYTES_PER_S = 125_000.0
# A caller told "busy" must start its request as fast as one given a slot (a silent stream
# is a stall either way); the rest of a big body may come slowly, and is cut off after this.
BUSY_DRAIN_TIMEOUT_S = 5.0
Handler = Callable[[str, bytes], Awaitable[bytes]]  # (caller's peer id, request) -> response
# The same, also given the remote address of the caller's connection (a Multiaddr).
AddressedHandler = Callable[[str, bytes, object], Awaitable[bytes]]
Authorize = Callable[[str], bool]


class Requester(Protocol):
    """The calling side of Transport, as components see it (tests hand in fakes)."""

    async def request(self, peer: str, protocol: str, payload: bytes, *, timeout_s: float,
                      max_response_bytes: int, paced_request: bool = False,
                      paced_response: bool = False) -> bytes: ...


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    return await read_body(reader, await read_length(reader, max_bytes))


async def read_length(reader: asyncio.StreamReader, max_bytes: int) -> int:
    try:
        length = int.from_bytes(await reader.readexactly(LENGTH_BYTES), "big")
    except asyncio.IncompleteReadError:
        raise StreamClosed("stream closed mid-frame") from None
    if length > max_bytes:
        raise Oversize(f"frame of {length} bytes exceeds the cap of {max_bytes}")
    return length


async def read_body(reader: asyncio.StreamReader, length: int) -> bytes:
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise StreamClosed("stream closed mid-frame") from None


async def discard_body(reader: asyncio.StreamReader, length: int) -> None:
    """Read a frame's body and throw it away, holding at most a chunk of it in memory."""
    try:
        while length:
            length -= len(await reader.readexactly(min(length, DISCARD_CHUNK_BYTES)))
    except asyncio.IncompleteReadError:
        raise StreamClosed("stream closed mid-frame") from None


async def write_frame(writer: asyncio.StreamWriter, data: bytes, *, read_next: bool = False) -> None:
    """``read_next``: the caller reads from the same connection next, and a BlockingPipe's
    read sends what was written before it, in the same trip to its thread (a trip is
    0.1-2 ms on 2 busy cores, a few % of a 40 MB body on loopback)."""
    writer.write(len(data).to_bytes(LENGTH_BYTES, "big"))
    writer.write(data)
    if not (read_next and isinstance(writer, BlockingPipe)):
        await writer.drain()


@dataclass(frozen=True)
class ServeLimits:
    max_request_bytes: int
    max_concurrent: int = 16
    max_per_peer: int = 4
    handler_timeout_s: float = 60.0  # the handler's work and the answer, once the request is in
    # A caller must start its request this soon and send its body at least this fast:
    # a slot held by a silent or trickling stream is freed, and the caller counted as a fault.
    first_bytes_timeout_s: float = 5.0
    min_request_bytes_per_s: float = 125_000.0  # 1 Mbit/s, far below any volunteer's uplink
    # Bulk bodies yield to other traffic (net/pacing.py): the protocol's request, or its
    # answer, is a paced body the receiver acknowledges. Caller and server must agree.
    paced_request: bool = False
    paced_response: bool = False
    # Streams one remote address may hold at once (None: half of max_concurrent). Fresh
    # identities cost nothing, addresses do: ten identities on one host holding silent
    # streams must leave slots for everyone else. Loopback is exempt (a swarm on one
    # machine shares it).
    max_per_address: int | None = None

    @property
    def address_cap(self) -> int:
        if self.max_per_address is not None:
            return self.max_per_address
        return max(self.max_per_peer, self.max_concurrent // 2)

    def request_deadline_s(self, length: int) -> float:
        """How long the body of a ``length``-byte request may take to arrive."""
        return self.first_bytes_timeout_s + length / self.min_request_bytes_per_s


MAX_REFUSED_LOGGED = 4096  # peers remembered as logged "refusing": identities are free
# A lane offer is a few bytes: one a second per caller is plenty (it opens lanes for minutes).
LANE_OFFER_LIMITS = ServeLimits(max_request_bytes=1024, max_concurrent=8, max_per_peer=1, handler_timeout_s=5.0)


class Transport:
    def __init__(self, p2p: P2P, on_fault: Callable[[str, str], None] = lambda peer, why: None,
                 on_reached: Callable[[str], None] = lambda peer: None, refusals: Refusals | None = None):
        self.p2p = p2p
        self.on_fault = on_fault  # a caller sent a malformed frame or stalled its request (net/guard.py)
        # streams refused, by reason (net/refusals.py): counted here, so on_fault need not count them
        self.refusals = refusals or Refusals()
        self.on_reached = on_reached  # a caller proved its peer id (the libp2p handshake) by calling us
        self.peer_id = str(p2p.peer_id)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.streams_served = 0  # inbound streams answered (a node nobody can dial answers none)
        self._active_per_peer: dict[tuple[str, str], int] = defaultdict(int)
        self._active_per_address: dict[tuple[str, str], int] = defaultdict(int)
        self._refused: set[str] = set()  # peers already logged as refused (once each, bounded)
        self._answering = 0  # streams being answered or waiting for their caller to close
        self._answered = asyncio.Event()  # set while none is
        self._answered.set()
        # direct lanes (net/lanes.py), once open_lanes has run: bulk protocols bypass p2pd
        self._lane_answers: dict[str, LaneAnswer] = {}
        self._lane_server: LaneServer | None = None
        self._tickets = Tickets()
        self.lanes: LanePool | None = None

    async def open_lanes(self, hosts: Sequence[str], port: int, *, encrypt_loopback: bool = False,
                         authorize: Authorize = lambda remote: True) -> int:
        """Accept direct lanes on ``hosts`` at ``port`` (0: any free port) and use other
        peers' lanes for our bulk requests; returns the port. Only peers ``authorize``
        admits get offers, and a ticket opens no lane once its holder is refused."""
        self._tickets = Tickets()  # a new server's: an old one's tickets open nothing here
        self._lane_server = LaneServer(LaneIdentity(), self._tickets, self._lane_answers.get,
                                       partial(self._fault, reason="malformed"), admit=authorize)
        port = await self._lane_server.start(hosts, port)
        await self.serve(protocols.LANE, self._offer_lane, LANE_OFFER_LIMITS, authorize, with_address=True)
        self.lanes = LanePool(self._ask_lane_offer, encrypt_loopback=encrypt_loopback)
        return port

    async def close_lanes(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        if self._lane_server is not None:
            await self.stop_serving(protocols.LANE)
            await self._lane_server.close()

    async def _offer_lane(self, remote: str, request: bytes, addr: object) -> bytes:
        server = self._lane_server
        if server is None or not server.port:
            return b""
        ticket = self._tickets.issue(remote, address_key(_ip_of(addr)))
        return Offer("", server.port, server.identity.cert_sha256, ticket, 0.0).to_wire()

    async def _ask_lane_offer(self, peer_id: str, timeout_s: float) -> tuple[bytes, str | None]:
        """The peer's lane offer, and the IP our libp2p connection to it goes to (None
        when that connection is relayed: its IP is the relay's)."""
        response, addr = await self._call(peer_id, protocols.LANE, b"", timeout_s=timeout_s,
                                          max_response_bytes=OFFER_BYTES)
        ip = None if "p2p-circuit" in str(addr) else _ip_of(addr)
        return response, None if ip is None else str(ip)

    async def request(self, peer_id: str, protocol: str, payload: bytes, *, timeout_s: float,
                      max_response_bytes: int, paced_request: bool = False, paced_response: bool = False) -> bytes:
        """Send one frame to ``peer_id``'s ``protocol`` handler and return its answer.
        ``paced_request`` / ``paced_response``: that direction is a paced body
        (net/pacing.py), as the protocol's server has it too. A bulk protocol goes over
        a direct lane to the peer when there is one (net/lanes.py), else over libp2p."""
        if self.lanes is not None and protocol in protocols.BULK and self.lanes.direct_to(peer_id):
            started = time.monotonic()
            lane = await self.lanes.take(peer_id, timeout_s)
            if lane is not None:
                return await self._request_on_lane(lane, peer_id, protocol, payload, timeout_s=timeout_s - (
                    time.monotonic() - started), max_response_bytes=max_response_bytes, paced_request=paced_request,
                                                    paced_response=paced_response)
            timeout_s -= time.monotonic() - started
        response, _ = await self._call(peer_id, protocol, payload, timeout_s=timeout_s,
                                       max_response_bytes=max_response_bytes, paced_request=paced_request,
                                       paced_response=paced_response)
        return response

    async def _call(self, peer_id: str, protocol: str, payload: bytes, *, timeout_s: float,
                    max_response_bytes: int, paced_request: bool = False,
                    paced_response: bool = False) -> tuple[bytes, object]:
        """One exchange on a new libp2p stream: (answer, the connection's remote address)."""
        writer = None
        try:
            async with asyncio.timeout(timeout_s):
                info, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                                                 protocol)
                return await self._exchange(reader, writer, info.addr, peer_id, payload, max_response_bytes,
                                            paced_request, paced_response), info.addr
        except TimeoutError:
            raise PeerTimeout(f"{protocol} to {short_id(peer_id)} timed out after {timeout_s:.1f}s") from None
        except (P2PDaemonError, P2PHandlerError, ConnectionError, OSError) as exc:
            raise PeerError(f"{protocol} to {short_id(peer_id)} failed: {exc}") from None
        finally:
            if writer is not None:
                writer.close()

    async def _request_on_lane(self, lane: Lane, peer_id: str, protocol: str, payload: bytes, *, timeout_s: float,
                               max_response_bytes: int, paced_request: bool, paced_response: bool) -> bytes:
        name = protocol.encode("ascii")
        done = False
        try:
            async with asyncio.timeout(timeout_s):
                lane.writer.write(bytes([len(name)]) + name)
                response = await self._exchange(lane.reader, lane.writer, lane.address, peer_id, payload,
                                                max_response_bytes, paced_request, paced_response)
                done = True
                return response
        except TimeoutError:
            raise PeerTimeout(f"{protocol} to {short_id(peer_id)} timed out after {timeout_s:.1f}s") from None
        except PeerRefused:
            done = True  # busy is a whole exchange: the lane is fine
            raise
        except (ConnectionError, OSError, ssl.SSLError) as exc:
            raise PeerError(f"{protocol} to {short_id(peer_id)} failed on its lane: {exc}") from None
        finally:
            (self.lanes.give_back if done else self.lanes.discard)(peer_id, lane)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, addr: object,
                        peer_id: str, payload: bytes, max_response_bytes: int, paced_request: bool,
                        paced_response: bool) -> bytes:
        if paced_request:
            await send_paced(writer, reader, payload, pacer_for(addr))
        else:
            await write_frame(writer, payload, read_next=True)
        self.bytes_sent += len(payload) + LENGTH_BYTES
        length = await read_length(reader, max_response_bytes)
        response = await (read_paced(reader, writer, length) if paced_response else read_body(reader, length))
        self.bytes_received += len(response) + LENGTH_BYTES
        if not response:
            raise PeerRefused(f"{short_id(peer_id)} is busy")
        return response

    async def serve(self, protocol: str, handler: Handler | AddressedHandler, limits: ServeLimits,
                    authorize: Authorize = lambda remote: True, *, with_address: bool = False) -> None:
        """Serve ``protocol``. ``authorize`` sees the caller's authenticated peer id (from
        the libp2p handshake); a caller it refuses gets its stream closed unread. With
        ``with_address`` the handler also gets the connection's remote address. A bulk
        protocol (protocols.BULK) is served on our direct lanes too, under the same caps."""
        gate = asyncio.Semaphore(limits.max_concurrent)
        # Streams being told "busy" are bounded too: past this many, a flood is closed unread.
        refusing = asyncio.Semaphore(2 * limits.max_concurrent)

        async def answer(remote: str, addr: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         lane: bool) -> bool:
            """One request and its answer; True when the exchange ended cleanly (a lane
            may then carry the caller's next request)."""
            key = (protocol, remote)
            if not authorize(remote):
                self.refusals.count("not-admitted")
                if remote not in self._refused:
                    if len(self._refused) >= MAX_REFUSED_LOGGED:
                        self._refused.clear()  # at worst a refused peer is logged again
                    self._refused.add(remote)
                    log.warning("refusing %s from %s: not admitted to this run", protocol, short_id(remote))
                return False
            self.on_reached(remote)
            where = (protocol, caller_address(addr))
            self._answering += 1
            self._answered.clear()
            response = b""
            try:
                if (gate.locked() or self._active_per_peer[key] >= limits.max_per_peer
                        or (where[1] is not None and self._active_per_address[where] >= limits.address_cap)):
                    self.refusals.count("busy")
                    if refusing.locked():
                        return False
                    async with refusing:
                        length = await self._request_length(reader, protocol, remote, limits)
                        async with asyncio.timeout(BUSY_DRAIN_TIMEOUT_S):
                            if limits.paced_request:  # the caller waits for acknowledgements as it sends
                                await read_paced(reader, writer, length, keep=False)
                            else:
                                await discard_body(reader, length)
                            await write_frame(writer, b"")  # busy: see the module docstring
                    return True
                self._active_per_peer[key] += 1
                self._active_per_address[where] += 1
                try:
                    async with gate:
                        request = await self._read_request(reader, writer, protocol, remote, limits)
                        async with asyncio.timeout(limits.handler_timeout_s):
                            response = await (handler(remote, request, addr) if with_address
                                              else handler(remote, request))
                            if limits.paced_response and response:  # busy (empty) is a plain frame
                                await send_paced(writer, reader, response, pacer_for(addr))
                            else:
                                await write_frame(writer, response)
                        self.bytes_sent += len(response) + LENGTH_BYTES
                finally:
                    for table, k in ((self._active_per_peer, key), (self._active_per_address, where)):
                        table[k] -= 1
                        if not table[k]:
                            del table[k]
                if not lane:
                    # after the slot is free: a caller's next request (the next state chunk)
                    # may arrive before it has closed this stream
                    await _linger(reader, LINGER_S + len(response) / MIN_ANSWER_BYTES_PER_S)
                return True
            except ProtocolError as exc:  # an oversize length prefix, or lies in a paced answer's acknowledgements
                self._fault(remote, f"bad {protocol} frame ({exc})",
                            "oversize" if isinstance(exc, Oversize) else "malformed")
            except (PeerError, TimeoutError, ConnectionError, OSError) as exc:
                log.debug("%s from %s: %s", protocol, short_id(remote), exc)
            finally:
                self._answering -= 1
                if not self._answering:
                    self._answered.set()
            return False

        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await answer(str(info.peer_id), info.addr, reader, writer, lane=False)
            finally:
                writer.close()

        if protocol in protocols.BULK:
            self._lane_answers[protocol] = partial(answer, lane=True)
        await self.p2p.add_binary_stream_handler(protocol, on_stream)

    async def answers_delivered(self) -> None:
        """Returns once every stream we answered has been closed by its caller (or given
        up on): a node that stops sooner cuts off answers still on their way, as a
        partner's outer payload on a slow uplink is (the caller sees "stream closed
        mid-frame" and loses the round)."""
        await self._answered.wait()

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, protocol: str,
                            remote: str, limits: ServeLimits) -> bytes:
        """The request, started within ``first_bytes_timeout_s`` and sent at the minimum
        rate; a caller that stalls is a fault (it held a slot others could have used)."""
        length = await self._request_length(reader, protocol, remote, limits)
        try:
            async with asyncio.timeout(limits.request_deadline_s(length)):
                request = await (read_paced(reader, writer, length) if limits.paced_request
                                 else read_body(reader, length))
        except TimeoutError:
            self._fault(remote, f"stalled its {protocol} request", "stalled")
            raise
        self.streams_served += 1
        self.bytes_received += len(request) + LENGTH_BYTES
        return request

    async def _request_length(self, reader: asyncio.StreamReader, protocol: str, remote: str,
                              limits: ServeLimits) -> int:
        """The request's length prefix, due within ``first_bytes_timeout_s`` whether the
        caller got a slot or is being told busy: a silent stream is a stall either way."""
        try:
            async with asyncio.timeout(limits.first_bytes_timeout_s):
                return await read_length(reader, limits.max_request_bytes)
        except TimeoutError:
            self._fault(remote, f"stalled its {protocol} request", "stalled")
            raise

    def _fault(self, remote: str, why: str, reason: str) -> None:
        self.refusals.count(reason)
        self.on_fault(remote, why)

    async def stop_serving(self, protocol: str) -> None:
        self._lane_answers.pop(protocol, None)
        try:
            await self.p2p.remove_binary_stream_handler(protocol)
        except (P2PDaemonError, P2PHandlerError, ConnectionError, OSError):
            pass


async def _linger(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Close only once the caller has: closing first lost the answer to a reset inside
    the daemons about once in 400 outer exchanges between healthy peers ("stream closed
    mid-frame" on the caller's side, after we had already averaged with it). The caller
    closes as soon as it has read the answer; one that keeps the stream open is cut."""
    try:
        await asyncio.wait_for(reader.read(1), timeout_s)
    except (TimeoutError, ConnectionError, OSError):
        pass


def caller_address(addr: object) -> str | None:
    """What per-address caps count a stream under, from the connection's multiaddr: its
    IPv4 address or IPv6 /64 (net/addresses.py); None for loopback (a swarm on one
    machine, and callers behind a local tunnel: only the other caps apply) or an address
    we cannot read."""
    key = address_key(_ip_of(addr))
    return None if key == LOOPBACK else key


def pacer_for(addr: object) -> Pacer | None:
    """A pacer for a bulk body to ``addr`` (the stream's remote multiaddr); none on
    loopback, where there is no uplink to share."""
    ip = _ip_of(addr)
    return None if ip is not None and ip.is_loopback else Pacer()


def _ip_of(addr: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    parts = str(addr).strip("/").split("/")
    if len(parts) < 2 or parts[0] not in ("ip4", "ip6"):
        return None
    try:
        return ipaddress.ip_address(parts[1])
    except ValueError:
        return None
