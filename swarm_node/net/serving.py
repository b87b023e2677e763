"""The serving side of a Transport: answering a protocol's streams, one request and one
answer each.

An empty answer frame means "busy" (the server is at its stream cap): the caller gets
PeerRefused and tries another peer without banning this one. The server reads (and
discards) the request before it answers busy: a handler that closes its stream with
request bytes still unread makes p2pd reset the stream, and the reset can overtake the
busy frame, turning a polite refusal into "stream closed mid-frame" at the caller.

What it owns: the caps a protocol is served under (ServeLimits): the request's size,
checked before it is read, the streams at once overall, per peer and per address, the
time a handler may take; a slot whose caller stalls its request or its answer freed
(net/stalls.py) and the caller counted as a fault; the callers refused (not admitted,
busy) counted by reason (net/refusals.py); and the answers still on their way when the
node stops. A bulk protocol is answered on the direct lanes too (net/lanes.py), under
the same caps."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError

from swarm_node.errors import Oversize, PeerError, ProtocolError
from swarm_node.net import protocols
from swarm_node.net.addresses import LOOPBACK, address_key
from swarm_node.net.identity import short_id
from swarm_node.net.lanes import LaneAnswer
from swarm_node.net.pacing import Meter, read_paced, send_paced
from swarm_node.net.refusals import Refusals
from swarm_node.net.stalls import Flows, Stalled, StallRule, discard_counted, moved, read_counted
from swarm_node.net.streams import LENGTH_BYTES, ip_of, pacer_for, read_length, write_frame

log = logging.getLogger("swarm_node.net.transport")  # one transport in the logs, both sides

LINGER_S = 2.0  # after answering, how long we wait for the caller to close first (plus the answer's transit)
# An answer handed to the daemon may still be on its way: a slow uplink moves a big one
# at no less than this (1 Mbit/s), and the caller closes only once it has read it all.
MIN_ANSWER_BYTES_PER_S = 125_000.0
MAX_REFUSED_LOGGED = 4096  # peers remembered as logged "refusing": identities are free
Handler = Callable[[str, bytes], Awaitable[bytes]]  # (caller's peer id, request) -> response
# The same, also given the remote address of the caller's connection (a Multiaddr).
AddressedHandler = Callable[[str, bytes, object], Awaitable[bytes]]
Authorize = Callable[[str], bool]


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


class StreamServer:
    """The serving side of net/transport.py's Transport, which is one."""

    def __init__(self, p2p: P2P, on_fault: Callable[[str, str], None], on_reached: Callable[[str], None],
                 refusals: Refusals | None):
        self.p2p = p2p
        self.on_fault = on_fault  # a caller sent a malformed frame or stalled its request (net/guard.py)
        # streams refused, by reason (net/refusals.py): counted here, so on_fault need not count them
        self.refusals = refusals or Refusals()
        self.on_reached = on_reached  # a caller proved its peer id (the libp2p handshake) by calling us
        self.bytes_sent = 0  # both ways, calls and answers
        self.bytes_received = 0
        self.streams_served = 0  # inbound streams answered (a node nobody can dial answers none)
        self._active_per_peer: dict[tuple[str, str], int] = defaultdict(int)
        self._active_per_address: dict[tuple[str, str], int] = defaultdict(int)
        self._refused: set[str] = set()  # peers already logged as refused (once each, bounded)
        self._answering = 0  # streams being answered or waiting for their caller to close
        self._answered = asyncio.Event()  # set while none is
        self._answered.set()
        self._flows = Flows()  # what each caller's open bodies move, together (net/stalls.py)
        self._lane_answers: dict[str, LaneAnswer] = {}  # bulk protocols' answers on our direct lanes

    async def serve(self, protocol: str, handler: Handler | AddressedHandler, limits: ServeLimits,
                    authorize: Authorize = lambda remote: True, *, with_address: bool = False) -> None:
        """Serve ``protocol``. ``authorize`` sees the caller's authenticated peer id (from
        the libp2p handshake); a caller it refuses gets its stream closed unread. With
        ``with_address`` the handler also gets the connection's remote address. A bulk
        protocol (protocols.BULK) is served on our direct lanes too, under the same caps."""
        gate = asyncio.Semaphore(limits.max_concurrent)
        # Streams being told "busy" are bounded too: past this many, a flood is closed unread.
        refusing = asyncio.Semaphore(2 * limits.max_concurrent)

        async def answer(remote: str, addr: object, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter,
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
            # an oversize length prefix, or lies in a paced answer's acknowledgements
            except ProtocolError as exc:
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
    key = address_key(ip_of(addr))
    return None if key == LOOPBACK else key


