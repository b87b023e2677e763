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
handler may take, and frees a slot whose caller stalls its request or its answer
(net/stalls.py). Peer ids passed around are base58 strings (authenticated by the
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
from swarm_node.net.pacing import BlockingPipe, Meter, Pacer, read_paced, send_paced
from swarm_node.net.refusals import Refusals
from swarm_node.net.stalls import Flows, StallRule, Stalled, discard_counted, moved, read_counted

log = logging.getLogger(__name__)

LENGTH_BYTES = 8
LINGER_S = 2.0  # after answering, how long we wait for the caller to close first (plus the answer's transit)
# An answer handed to the daemon may still be on its way: a slow uplink moves a big one
# at no less than this (1 Mbit/s), and the caller closes only once it has read it all.
MIN_ANSWER_BYTES_PER_S = 125_000.0
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
    # A caller's requests, and the paced answers it acknowledges, must not stall
    # (net/stalls.py): a request starts within first_bytes_timeout_s (unless the caller's
    # other requests are moving), the caller moves something every stall_s and pays
    # min_bytes_per_s for each body it holds open. A slot held by a silent, trickling or
    # unread stream is freed and the caller counted as a fault; one still moving after
    # handler_timeout_s is freed without a fault.
    first_bytes_timeout_s: float = 5.0
    stall_s: float = 30.0
    # 32 kbit/s: a fifth of one stream's share when six share a full 1 Mbit/s uplink
    min_bytes_per_s: float = 4_000.0
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

    def stall_rule(self, max_s: float | None = None) -> StallRule:
        """When a body stalls (net/stalls.py); ``max_s``: its longest (default: the handler's)."""
        return StallRule(self.stall_s, self.min_bytes_per_s,
                         self.handler_timeout_s if max_s is None else max_s, self.first_bytes_timeout_s)


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
        self._flows = Flows()  # what each caller's open bodies move, together (net/stalls.py)
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
                    async with refusing:  # read and thrown away: see the module docstring
                        await self._read_request(reader, writer, protocol, remote, limits, keep=False)
                        async with asyncio.timeout(limits.stall_s):
                            await write_frame(writer, b"")
                    return True
                self._active_per_peer[key] += 1
                self._active_per_address[where] += 1
                try:
                    async with gate:
                        request = await self._read_request(reader, writer, protocol, remote, limits)
                        call = partial(handler, remote, request, addr) if with_address else partial(
                            handler, remote, request)
                        response = await self._respond(call, reader, writer, addr, protocol, remote, limits)
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
                            remote: str, limits: ServeLimits, keep: bool = True) -> bytes:
        """The request, kept or (``keep`` False: told busy) thrown away, read unless it
        stalls (net/stalls.py: a silent stream, whether it got a slot or is told busy, is
        cut after ``first_bytes_timeout_s``); a caller that stalls is a fault (it held a
        slot others could have used)."""
        meter, length = Meter(), None
        try:
            async with self._flows.watch((remote, "in"), limits.stall_rule(), moved(reader, meter),
                                         begun=lambda: length is not None):
                length = await read_length(reader, limits.max_request_bytes)
                if limits.paced_request:  # the caller waits for acknowledgements as it sends
                    request = await read_paced(reader, writer, length, keep=keep, meter=meter)
                else:
                    request = await (read_counted if keep else discard_counted)(reader, length, meter)
        except Stalled:
            self._fault(remote, f"stalled its {protocol} request", "stalled")
            raise
        if keep:
            self.streams_served += 1
            self.bytes_received += len(request) + LENGTH_BYTES
        return request

    async def _respond(self, handle: Callable[[], Awaitable[bytes]], reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, addr: object, protocol: str, remote: str,
                       limits: ServeLimits) -> bytes:
        """The handler's answer, written within ``handler_timeout_s`` of the request (or
        ``stall_s`` of the answer, when the handler left less); a caller that stops taking
        it (a paced answer it stalls by net/stalls.py's rule, or a plain answer still being
        written at that deadline: an honest caller gave up and closed by then) is a fault,
        as a stalled request is."""
        loop = asyncio.get_running_loop()
        until = loop.time() + limits.handler_timeout_s
        async with asyncio.timeout_at(until):
            response = await handle()
        until = max(until, loop.time() + limits.stall_s)
        try:
            if limits.paced_response and response:  # busy (empty) is a plain frame
                meter = Meter()
                async with self._flows.watch((remote, "out"), limits.stall_rule(max_s=until - loop.time()),
                                             moved(None, meter)):
                    await send_paced(writer, reader, response, pacer_for(addr), meter)
            else:  # shows no progress: not taken by the deadline is a stall
                async with asyncio.timeout_at(until):
                    await write_frame(writer, response)
        except TimeoutError as exc:
            if isinstance(exc, Stalled) or not (limits.paced_response and response):
                self._fault(remote, f"stalled reading its {protocol} answer", "stalled")
            raise
        self.bytes_sent += len(response) + LENGTH_BYTES
        return response

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
