"""Request/response over libp2p binary streams: one stream per call, one length-prefixed
frame each way (net/streams.py). This module is the calling side and the Transport
that components hold: a call to a peer's protocol, over libp2p or, for a bulk protocol,
over a direct lane to the peer (net/lanes.py); its serving side, the caps and the busy
answer, is net/serving.py's (Transport is a StreamServer).

The caller owns the deadline of every call; a busy answer is PeerRefused (the caller
tries another peer without banning this one). Peer ids passed around are base58
strings (authenticated by the libp2p handshake)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from swarm_node.errors import PeerError, PeerRefused, PeerTimeout
from swarm_node.net import protocols
from swarm_node.net.addresses import address_key
from swarm_node.net.identity import short_id  # components import it from here too
from swarm_node.net.lanes import (
    OFFER_BYTES,
    Lane,
    LaneIdentity,
    LanePool,
    LaneServer,
    Offer,
    Tickets,
)
from swarm_node.net.pacing import read_paced, send_paced
from swarm_node.net.refusals import Refusals
from swarm_node.net.serving import Authorize, ServeLimits, StreamServer
from swarm_node.net.streams import LENGTH_BYTES, ip_of, pacer_for, read_body, read_length, write_frame

log = logging.getLogger(__name__)


BodySent = Callable[[float], None]  # a request's last byte is written: the seconds since its first


class Requester(Protocol):
    """The calling side of Transport, as components see it (tests hand in fakes)."""

    async def request(self, peer: str, protocol: str, payload: bytes, *, timeout_s: float,
                      max_response_bytes: int, paced_request: bool = False,
                      paced_response: bool = False, on_sent: BodySent | None = None) -> bytes: ...


# A lane offer is a few bytes: one a second per caller is plenty (it opens lanes for minutes).
LANE_OFFER_LIMITS = ServeLimits(max_request_bytes=1024, max_concurrent=8, max_per_peer=1,
                                handler_timeout_s=5.0)


class Transport(StreamServer):
    def __init__(self, p2p: P2P, on_fault: Callable[[str, str], None] = lambda peer, why: None,
                 on_reached: Callable[[str], None] = lambda peer: None, refusals: Refusals | None = None):
        super().__init__(p2p, on_fault, on_reached, refusals)
        self.peer_id = str(p2p.peer_id)
        # direct lanes (net/lanes.py), once open_lanes has run: bulk protocols bypass p2pd
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
        ticket = self._tickets.issue(remote, address_key(ip_of(addr)))
        return Offer("", server.port, server.identity.cert_sha256, ticket, 0.0).to_wire()

    async def _ask_lane_offer(self, peer_id: str, timeout_s: float) -> tuple[bytes, str | None]:
        """The peer's lane offer, and the IP our libp2p connection to it goes to (None
        when that connection is relayed: its IP is the relay's)."""
        response, addr = await self._call(peer_id, protocols.LANE, b"", timeout_s=timeout_s,
                                          max_response_bytes=OFFER_BYTES)
        ip = None if "p2p-circuit" in str(addr) else ip_of(addr)
        return response, None if ip is None else str(ip)

    async def request(self, peer_id: str, protocol: str, payload: bytes, *, timeout_s: float,
                      max_response_bytes: int, paced_request: bool = False,
                      paced_response: bool = False, on_sent: BodySent | None = None) -> bytes:
        """Send one frame to ``peer_id``'s ``protocol`` handler and return its answer.
        ``paced_request`` / ``paced_response``: that direction is a paced body
        (net/pacing.py), as the protocol's server has it too. A bulk protocol goes over
        a direct lane to the peer when there is one (net/lanes.py), else over libp2p.
        ``on_sent``: called once the request's last byte is written, with the seconds it
        took from its first (a lane or stream opened first not counted; a paced request's
        pace is its acknowledgements', so this is its rate less a window)."""
        if self.lanes is not None and protocol in protocols.BULK and self.lanes.direct_to(peer_id):
            started = time.monotonic()
            lane = await self.lanes.take(peer_id, timeout_s)
            if lane is not None:
                return await self._request_on_lane(lane, peer_id, protocol, payload,
                                                   timeout_s=timeout_s - (time.monotonic() - started),
                                                   max_response_bytes=max_response_bytes,
                                                   paced_request=paced_request, paced_response=paced_response,
                                                   on_sent=on_sent)
            timeout_s -= time.monotonic() - started
        response, _ = await self._call(peer_id, protocol, payload, timeout_s=timeout_s,
                                       max_response_bytes=max_response_bytes, paced_request=paced_request,
                                       paced_response=paced_response, on_sent=on_sent)
        return response

    async def _call(self, peer_id: str, protocol: str, payload: bytes, *, timeout_s: float,
                    max_response_bytes: int, paced_request: bool = False, paced_response: bool = False,
                    on_sent: BodySent | None = None) -> tuple[bytes, object]:
        """One exchange on a new libp2p stream: (answer, the connection's remote address)."""
        writer = None
        try:
            async with asyncio.timeout(timeout_s):
                info, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                                                 protocol)
                return await self._exchange(reader, writer, info.addr, peer_id, payload, max_response_bytes,
                                            paced_request, paced_response, on_sent), info.addr
        except TimeoutError:
            raise PeerTimeout(f"{protocol} to {short_id(peer_id)} timed out after {timeout_s:.1f}s") from None
        except (P2PDaemonError, P2PHandlerError, ConnectionError, OSError) as exc:
            raise PeerError(f"{protocol} to {short_id(peer_id)} failed: {exc}") from None
        finally:
            if writer is not None:
                writer.close()

    async def _request_on_lane(self, lane: Lane, peer_id: str, protocol: str, payload: bytes, *,
                               timeout_s: float,
                               max_response_bytes: int, paced_request: bool, paced_response: bool,
                               on_sent: BodySent | None = None) -> bytes:
        name = protocol.encode("ascii")
        done = False
        try:
            async with asyncio.timeout(timeout_s):
                lane.writer.write(bytes([len(name)]) + name)
                response = await self._exchange(lane.reader, lane.writer, lane.address, peer_id, payload,
                                                max_response_bytes, paced_request, paced_response, on_sent)
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
                        paced_response: bool, on_sent: BodySent | None = None) -> bytes:
        started = time.monotonic()
        written = None if on_sent is None else lambda: on_sent(time.monotonic() - started)
        if paced_request:
            await send_paced(writer, reader, payload, pacer_for(addr), written=written)
        else:
            await write_frame(writer, payload, read_next=True)
            if written is not None:
                written()
        self.bytes_sent += len(payload) + LENGTH_BYTES
        length = await read_length(reader, max_response_bytes)
        response = await (read_paced(reader, writer, length) if paced_response else read_body(reader, length))
        self.bytes_received += len(response) + LENGTH_BYTES
        if not response:
            raise PeerRefused(f"{short_id(peer_id)} is busy")
        return response
