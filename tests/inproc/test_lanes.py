"""Direct lanes (net/lanes.py) between real libp2p peers: a bulk protocol's requests go
over one TLS lane (opened once, then reused) with the same answers, paced bodies and
caps as on libp2p streams; control protocols stay on libp2p; a peer without lanes, a
lane whose certificate is not the one the offer named, or a forged ticket never gets
a request through a lane, and the callers still get their answers over libp2p. A lane
opens only once each end has proven it holds the ticket (whatever else answers at the
port is written neither the ticket nor a request), a refused ticket costs its caller one
request over libp2p, and the tables of both sides stay bounded, by peer and by address."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import ssl

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm_node.errors import PeerError, PeerRefused, ProtocolError
from swarm_node.net import lane_auth, lanes, protocols
from swarm_node.net.dht import SwarmDHT
from swarm_node.net.lanes import LANE_HELLO, Lane, LanePool, Offer, Tickets
from swarm_node.net.serving import caller_address
from swarm_node.net.transport import ServeLimits, Transport

ACCEPTED, REFUSED = b"\x01", b"\x00"

BULK = protocols.FORWARD  # any bulk protocol: the transport does not look inside
BULK_PACED = protocols.OUTER
CONTROL = protocols.STATUS
LOOPBACK = ["127.0.0.1"]
HELD: asyncio.Event  # set by the test that holds requests, once the others have their answers


async def two_peers(*, server_lanes: bool = True, client_lanes: bool = True, tls: bool = True, admit=None):
    global HELD
    HELD = asyncio.Event()  # of this test's loop
    server, client = await SwarmDHT.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), await SwarmDHT.start(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await client.rebootstrap(server.visible_maddrs())
    faults = []
    serving = Transport(await server.replicate_p2p(), on_fault=lambda peer, why: faults.append((peer, why)))
    calling = Transport(await client.replicate_p2p())
    seen = []  # (protocol, caller, how the request came: its remote address)

    def recorder(protocol):
        async def handler(remote: str, request: bytes, addr) -> bytes:
            seen.append((protocol, remote, str(addr)))
            if request == b"hold":  # until the test lets go: every other request must meet it held
                await HELD.wait()
            return request[::-1]
        return handler

    for protocol, paced in ((BULK, False), (BULK_PACED, True), (CONTROL, False)):
        await serving.serve(protocol, recorder(protocol),
                            ServeLimits(max_request_bytes=64 << 20, max_per_peer=2, paced_request=paced,
                                        paced_response=paced), with_address=True)
    lane_port = None
    if server_lanes:
        lane_port = await (serving.open_lanes(LOOPBACK, 0) if admit is None else
                           serving.open_lanes(LOOPBACK, 0, authorize=admit))
    if client_lanes:  # TLS even on loopback, as between hosts, unless a test asks for the loopback shortcut
        await calling.open_lanes(LOOPBACK, 0, encrypt_loopback=tls)
    return server, client, serving, calling, seen, faults, lane_port


async def open_by_hand(reader, writer, ticket: bytes, port: int) -> bool:
    """A lane's opening, caller's side, as docs/PROTOCOL.md 1.1 writes it: True once the
    server has proven it holds ``ticket`` (at ``port``) and we have answered its challenge."""
    challenge = os.urandom(32)
    writer.write(LANE_HELLO + challenge + hashlib.sha256(b"swarm-node lane ticket\n" + ticket).digest())
    await writer.drain()
    if await asyncio.wait_for(reader.readexactly(1), 10) != ACCEPTED:
        return False
    reply = await asyncio.wait_for(reader.readexactly(64), 10)
    proof = hmac.new(ticket, b"swarm-node lane 2 server\n" + challenge + port.to_bytes(2, "big"),
                     hashlib.sha256)
    assert hmac.compare_digest(reply[:32], proof.digest())
    writer.write(hmac.new(ticket, b"swarm-node lane 2 caller\n" + reply[32:], hashlib.sha256).digest())
    return True


async def close(*dhts, transports=()):
    for transport in transports:
        await transport.close_lanes()
    for dht in dhts:
        await dht.shutdown()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain on loopback"])
def test_bulk_requests_share_one_lane_with_libp2p_answers_and_control_stays_on_libp2p(tls):
    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(tls=tls)
        try:
            big = os.urandom(24 << 20)
            answers = [await calling.request(server.peer_id, BULK, f"hello {i}".encode(), timeout_s=30,
                                             max_response_bytes=1 << 20) for i in range(5)]
            paced = await calling.request(server.peer_id, BULK_PACED, big, timeout_s=60,
                                          max_response_bytes=32 << 20, paced_request=True,
                                          paced_response=True)
            status = await calling.request(server.peer_id, CONTROL, b"status?", timeout_s=30,
                                           max_response_bytes=1024)
            return (answers, paced == big[::-1], status, seen, calling.lanes.lanes_opened,
                    serving._lane_server.requests, faults, client.peer_id)
        finally:
            await close(server, client, transports=(serving, calling))

    answers, paced_ok, status, seen, opened, over_lanes, faults, caller = asyncio.run(
        asyncio.wait_for(scenario(), 120))
    assert answers == [f"hello {i}".encode()[::-1] for i in range(5)] and paced_ok and status == b"?sutats"
    assert opened == 1  # six bulk requests, one after the other, on one lane
    assert over_lanes == 6 and [protocol for protocol, _, _ in seen] == [BULK] * 5 + [BULK_PACED, CONTROL]
    lane_address = seen[0][2]
    assert {addr for _, _, addr in seen[:6]} == {lane_address} and seen[6][2] != lane_address
    assert {caller for _, caller, _ in seen} == {caller}  # the ticket said whose lane it is
    assert not faults


def test_concurrent_requests_open_several_lanes_and_caps_hold_on_lanes():
    """Per-caller caps are the protocol's, whichever path a request takes: with
    max_per_peer 2, five held requests at once get two answers and three busy."""
    async def scenario():
        server, client, serving, calling, seen, faults, _ = await two_peers()
        try:
            calls = [asyncio.create_task(calling.request(server.peer_id, BULK, b"hold", timeout_s=60,
                                                         max_response_bytes=1024)) for _ in range(5)]
            while sum(call.done() for call in calls) < 3:  # the three told busy while two are held
                await asyncio.wait([c for c in calls if not c.done()], return_when=asyncio.FIRST_COMPLETED)
            HELD.set()
            results = await asyncio.gather(*calls, return_exceptions=True)
            again = await calling.request(server.peer_id, BULK, b"again", timeout_s=30,
                                          max_response_bytes=1024)
            return results, again, calling.lanes.lanes_opened
        finally:
            await close(server, client, transports=(serving, calling))

    results, again, opened = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert sum(r == b"dloh" for r in results) == 2
    assert sum(isinstance(r, PeerRefused) for r in results) == 3, results
    assert again == b"niaga"
    assert 2 <= opened <= lanes.MAX_LANES_PER_PEER  # a busy answer leaves its lane usable


@pytest.mark.parametrize("case", ["server without lanes", "certificate not the offer's"])
def test_no_usable_lane_means_libp2p_with_the_same_answers(case, monkeypatch, caplog):
    async def scenario():
        server, client, serving, calling, seen, faults, _ = await two_peers(
            server_lanes=case != "server without lanes"
        )
        if case == "certificate not the offer's":  # a man in the middle: another key answers the dial
            serving._lane_server.identity.cert_sha256 = bytes(32)
        try:
            answers = [await calling.request(server.peer_id, BULK, b"abc", timeout_s=30,
                                             max_response_bytes=1024) for _ in range(3)]
            over_lanes = serving._lane_server.requests if serving._lane_server else 0
            return answers, calling.lanes.lanes_opened, over_lanes, calling.lanes.direct_to(server.peer_id)
        finally:
            await close(server, client, transports=(serving, calling))

    with caplog.at_level("INFO", logger="swarm_node.net.lanes"):
        answers, opened, over_lanes, direct = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answers == [b"cba"] * 3 and opened == 0 and over_lanes == 0 and not direct
    said = [r.getMessage() for r in caplog.records if "no direct lane" in r.getMessage()]
    assert len(said) == 1, said  # logged once, however many requests fell back


def test_a_lane_with_a_forged_ticket_carries_nothing():
    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(client_lanes=False)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", lane_port, ssl=context)
            name = BULK.encode()
            hello = LANE_HELLO + os.urandom(64)  # a challenge, and the hash of no ticket
            writer.write(hello + bytes([len(name)]) + name + (3).to_bytes(8, "big") + b"abc")
            await writer.drain()
            leftover = await asyncio.wait_for(reader.read(), 10)  # the server refuses it, and closes
            writer.close()
            return leftover, seen, serving._lane_server.requests
        finally:
            await close(server, client, transports=(serving,))

    leftover, seen, over_lanes = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert leftover == REFUSED and seen == [] and over_lanes == 0


def test_tickets_are_bounded_expire_and_belong_to_whoever_asked():
    now = [0.0]
    tickets = Tickets(clock=lambda: now[0])
    mine = [tickets.issue("peer-a") for _ in range(lanes.MAX_TICKETS_PER_PEER + 2)]
    assert tickets.redeem(mine[0]) is None and tickets.redeem(mine[-1]) == "peer-a"  # a peer keeps its newest
    other = tickets.issue("peer-b")
    now[0] += lanes.TICKET_TTL_S + 1
    assert tickets.redeem(other) is None and tickets.redeem(os.urandom(32)) is None
    for i in range(lanes.MAX_TICKETS + 10):
        tickets.issue(f"peer-{i}")
    assert len(tickets) <= lanes.MAX_TICKETS


@given(st.binary(max_size=300))
def test_an_offer_parses_or_is_a_protocol_error(raw):
    try:
        offer = Offer.from_wire(raw, "10.0.0.1", now=100.0)
    except ProtocolError:
        return
    assert (
        0 < offer.port < 65536
        and len(offer.ticket) == lanes.TICKET_BYTES
        and offer.expires_at <= 100.0 + lanes.TICKET_TTL_S
    )


@given(st.integers(0, 70000), st.binary(min_size=0, max_size=40), st.binary(min_size=0, max_size=40),
       st.one_of(st.floats(allow_nan=True), st.integers(-10, 10**9), st.booleans(), st.none()))
def test_a_well_formed_offer_round_trips_and_a_bent_one_is_refused(port, cert, ticket, ttl):
    import msgpack

    raw = msgpack.packb({"port": port, "cert": cert, "ticket": ticket, "ttl": ttl})
    valid = (0 < port < 65536 and len(cert) == 32 and len(ticket) == lanes.TICKET_BYTES
             # NaN is no lifetime
             and isinstance(ttl, int | float) and not isinstance(ttl, bool) and ttl == ttl)
    if valid:
        offer = Offer.from_wire(raw, "10.0.0.1", now=0.0)
        assert (offer.port, offer.cert_sha256, offer.ticket) == (port, cert, ticket)
        assert 0.0 <= offer.expires_at <= lanes.TICKET_TTL_S
    else:
        with pytest.raises(ProtocolError):
            Offer.from_wire(raw, "10.0.0.1", now=0.0)


def test_a_control_protocol_asked_on_a_lane_is_a_fault_of_the_ticket_holder():
    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(client_lanes=False)
        ticket = serving._tickets.issue(client.peer_id)  # as the offer would give it to the client
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", lane_port)  # loopback: plain TCP
            assert await open_by_hand(reader, writer, ticket, lane_port)
            name = CONTROL.encode()
            writer.write(bytes([len(name)]) + name + (3).to_bytes(8, "big") + b"abc")
            await writer.drain()
            leftover = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return leftover, seen, faults, client.peer_id, serving.refusals.as_dict()
        finally:
            await close(server, client, transports=(serving,))

    leftover, seen, faults, caller, refusals = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert leftover == b"" and seen == []
    assert [peer for peer, _ in faults] == [caller] and "does not carry it" in faults[0][1]
    assert refusals["malformed"] == 1 and sum(refusals.values()) == 1  # counted once, under its reason


def test_connections_that_never_finish_their_handshake_are_bounded(monkeypatch):
    """Each connection holds a thread from accept on, so silent ones count against the
    cap before any ticket: past it, a connection is closed at once."""
    monkeypatch.setattr(lanes, "MAX_INBOUND", 3)

    async def scenario():
        server, client, serving, calling, seen, faults, lane_port = await two_peers(client_lanes=False)
        try:
            silent = [await asyncio.open_connection("127.0.0.1", lane_port) for _ in range(3)]
            lane_server = serving._lane_server
            async with asyncio.timeout(10):  # until the server holds all three
                while len(lane_server._accepting) - len(lane_server._listeners) < 3:
                    await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", lane_port)
            closed_at_once = await asyncio.wait_for(reader.read(), 3) == b""
            held = [not r.at_eof() for r, _ in silent]
            for _, w in [*silent, (reader, writer)]:
                w.close()
            return closed_at_once, held
        finally:
            await close(server, client, transports=(serving,))

    closed_at_once, held = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert closed_at_once and all(held)


# -- opening a lane: who is at the other end, tickets and what a caller does when refused ----

def drop_idle_lanes(calling: Transport, peer: str) -> None:
    """What CALLER_IDLE_S does to the caller's idle lanes: its next request needs a new one."""
    for lane in calling.lanes._idle.pop(peer, []):
        calling.lanes.discard(peer, lane)


async def until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def ask(calling: Transport, server, text: bytes) -> bytes:
    return await calling.request(server.peer_id, BULK, text, timeout_s=30, max_response_bytes=1024)


def test_each_lane_from_one_address_is_counted_while_open_and_no_longer(monkeypatch):
    """Lanes from one remote address come and go: each counts against the address while
    it is open and not after, so lanes past MAX_INBOUND_PER_ADDRESS of them in all are
    served like the first, and the count by address keeps no entry for a closed lane."""
    monkeypatch.setattr(lanes, "_address_of", lambda raw: "198.51.100.7")  # as if from another host
    rounds = lanes.MAX_INBOUND_PER_ADDRESS + 4

    async def scenario():
        server, client, serving, calling, *_ = await two_peers(tls=False)
        lane_server, counted, answers = serving._lane_server, [], []
        try:
            for i in range(rounds):
                answers.append(await ask(calling, server, b"%d" % i))
                drop_idle_lanes(calling, server.peer_id)
                await until(lambda: not lane_server._inbound)  # the server has seen it close
                counted.append(dict(lane_server._by_address))
            return answers, counted, calling.lanes.lanes_opened, lane_server.requests
        finally:
            await close(server, client, transports=(serving, calling))

    answers, counted, opened, over_lanes = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answers == [(b"%d" % i)[::-1] for i in range(rounds)]
    assert counted == [{}] * rounds and opened == rounds and over_lanes == rounds


@pytest.mark.parametrize("flood_from", ["another host", "the caller's address"])
def test_a_flood_of_lane_offers_to_fresh_identities_costs_a_caller_one_request_on_libp2p_at_most(flood_from):
    """4,096 identities each given a ticket (the table's size). From another host they
    replace their own tickets and the caller's stays good; from the caller's own address
    they push its ticket out, the server says so at its next lane, and that one request
    goes over libp2p: the next asks a new offer and has its lane again."""
    async def scenario():
        server, client, serving, calling, *_ = await two_peers()
        try:
            answers = [await ask(calling, server, b"first")]
            drop_idle_lanes(calling, server.peer_id)  # the next request opens a lane on the offer kept
            address = "198.51.100.7" if flood_from == "another host" else lanes.LOOPBACK
            for i in range(lanes.MAX_TICKETS):
                serving._tickets.issue(f"QmSybil{i}", address)
            answers += [await ask(calling, server, b"then %d" % i) for i in range(4)]
            return (answers, calling.lanes.refused, calling.lanes.lanes_opened, serving._lane_server.requests,
                    calling.lanes.direct_to(server.peer_id))
        finally:
            await close(server, client, transports=(serving, calling))

    answers, refused, opened, over_lanes, direct = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answers == [b"tsrif"] + [(b"then %d" % i)[::-1] for i in range(4)] and direct
    if flood_from == "another host":
        assert (refused, opened, over_lanes) == (0, 2, 5)
    else:
        assert (refused, opened, over_lanes) == (1, 2, 4)  # "then 0" went over libp2p


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain on loopback"])
def test_a_lane_server_restarted_on_its_port_costs_one_request_over_libp2p(tls):
    """The peer's lane server restarted at the same port (a fixed --lane-port): the idle
    lane to the old one reads as closed and is not used, the new one refuses the ticket
    of the offer we kept (or, in TLS, shows another certificate) before any request is
    sent, that request goes over libp2p, and the next opens a lane on a new offer."""
    async def scenario():
        server, client, serving, calling, *_ = await two_peers(tls=tls)
        try:
            answers = [await ask(calling, server, b"first")]
            idle = list(calling.lanes._idle[server.peer_id])
            port = serving._lane_server.port
            await serving.close_lanes()
            await serving.open_lanes(LOOPBACK, port)
            await until(lambda: all(lane.io.readable_within(0.0) for lane in idle))  # its end has arrived
            answers += [await ask(calling, server, b"then %d" % i) for i in range(3)]
            return (answers, calling.lanes.lanes_opened, serving._lane_server.requests,
                    calling.lanes.direct_to(server.peer_id))
        finally:
            await close(server, client, transports=(serving, calling))

    answers, opened, over_new_lanes, direct = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answers == [b"tsrif"] + [(b"then %d" % i)[::-1] for i in range(3)]
    assert opened == 2 and over_new_lanes == 2 and direct  # "then 0" over libp2p, then a lane


def test_a_process_on_a_lane_s_old_port_learns_no_ticket_and_answers_nothing(monkeypatch):
    """Another program takes the port of a peer's closed lane server (plain TCP: no
    certificate to pin). It does its best (it says yes to whatever hello comes, and
    answers any request it sees), but the caller never writes it the ticket nor a
    request, and gets the peer's own answers over libp2p."""
    monkeypatch.setattr(lanes, "CALLER_IDLE_S", 0.0)  # every request opens a lane of its own
    received: list[bytes] = []

    async def squat(reader, writer):
        got, said_yes = bytearray(), False
        try:
            while chunk := await asyncio.wait_for(reader.read(1 << 16), 10):
                got += chunk
                if BULK.encode() in got:
                    writer.write((6).to_bytes(8, "big") + b"forged")
                elif got.startswith(b"swarm-node lane 2\n") and len(got) >= 82 and not said_yes:
                    writer.write(ACCEPTED + os.urandom(64))  # a guess at the proof and a challenge
                    said_yes = True
                await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            received.append(bytes(got))
            writer.close()

    async def scenario():
        server, client, serving, calling, _, _, lane_port = await two_peers(tls=False)
        try:
            answers = [await ask(calling, server, b"first")]
            ticket = calling.lanes._offers[server.peer_id].ticket
            await serving._lane_server.close()
            squatter = await asyncio.start_server(squat, "127.0.0.1", lane_port)
            try:
                answers += [await ask(calling, server, b"then %d" % i) for i in range(2)]
                await until(lambda: received)
            finally:
                squatter.close()
            return answers, ticket
        finally:
            await close(server, client, transports=(serving, calling))

    answers, ticket = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answers == [b"tsrif", b"0 neht", b"1 neht"]
    assert received and all(ticket not in got and BULK.encode() not in got for got in received), received


def test_a_peer_that_names_another_program_s_port_gets_nothing_of_its_choosing_written_there(monkeypatch):
    """A hostile peer's offer names a local line server's port (Redis, say) and a
    ticket that is a command. The caller writes only its hello line, a random challenge
    and the ticket's hash there, reads no proof, and uses libp2p."""
    lines: list[bytes] = []

    async def line_server(reader, writer):  # one command a line, an error for each unknown one
        try:
            while line := await asyncio.wait_for(reader.readline(), 10):
                lines.append(line)
                writer.write(b"-ERR unknown command\r\n")
                await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):
            pass
        finally:
            lines.append(b"<closed>")
            writer.close()

    async def scenario():
        program = await asyncio.start_server(line_server, "127.0.0.1", 0)
        port = program.sockets[0].getsockname()[1]

        async def hostile_offer(self, *request):
            return Offer("", port, bytes(32), b"\nSET pwned 1\n".ljust(32), 0.0).to_wire()

        monkeypatch.setattr(Transport, "_offer_lane", hostile_offer)
        server, client, serving, calling, *_ = await two_peers(tls=False)
        try:
            answers = [await ask(calling, server, b"x%d" % i) for i in range(2)]
            await until(lambda: b"<closed>" in lines)
            return answers, calling.lanes.direct_to(server.peer_id)
        finally:
            program.close()
            await close(server, client, transports=(serving, calling))

    answers, direct = asyncio.run(asyncio.wait_for(scenario(), 120))
    written = b"".join(lines)
    assert answers == [b"0x", b"1x"] and not direct
    assert written.startswith(LANE_HELLO) and b"pwned" not in written, written


def test_only_admitted_peers_get_offers_and_a_ticket_opens_nothing_once_its_holder_is_refused(monkeypatch):
    monkeypatch.setattr(lanes, "CALLER_IDLE_S", 0.0)  # every request opens a lane of its own
    banned: set[str] = set()

    async def scenario():
        server, client, serving, calling, *_ = await two_peers(admit=lambda peer: peer not in banned)
        try:
            answers = [await ask(calling, server, b"admitted")]
            banned.add(client.peer_id)  # (the test's handlers still answer it over libp2p)
            answers += [await ask(calling, server, b"banned %d" % i) for i in range(2)]
            lane_server = serving._lane_server
            return (answers, calling.lanes.lanes_opened, calling.lanes.refused, lane_server.requests,
                    len(serving._tickets), dict(lane_server._inbound),
                    calling.lanes.direct_to(server.peer_id))
        finally:
            await close(server, client, transports=(serving, calling))

    answers, *counts = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert answers == [b"dettimda", b"0 dennab", b"1 dennab"]
    # the first lane; the kept offer's ticket refused at the next; no new offer for a banned peer
    assert counts == [1, 1, 1, 1, {}, False]  # opened, refused, over lanes, tickets, lanes held, direct


def test_loopback_callers_hold_at_most_their_share_of_lane_connections(monkeypatch):
    """Everything on this machine, and whatever a local tunnel lets in, counts as one
    address with half the connections: callers at addresses of their own keep the rest."""
    monkeypatch.setattr(lanes, "MAX_INBOUND_LOOPBACK", 2, raising=False)

    async def scenario():
        server, client, serving, _, _, _, lane_port = await two_peers(client_lanes=False)
        try:
            silent = [await asyncio.open_connection("127.0.0.1", lane_port) for _ in range(2)]
            lane_server = serving._lane_server
            await until(lambda: len(lane_server._accepting) - len(lane_server._listeners) == 2)
            reader, writer = await asyncio.open_connection("127.0.0.1", lane_port)
            closed_at_once = await asyncio.wait_for(reader.read(), 3) == b""
            for _, w in [*silent, (reader, writer)]:
                w.close()
            return closed_at_once
        finally:
            await close(server, client, transports=(serving,))

    assert asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_ipv6_host_is_one_address_for_the_caps_and_ipv4_is_the_same_through_ipv6():
    class Raw:
        def __init__(self, ip):
            self.ip = ip

        def getpeername(self):
            return (self.ip, 4001)

    same_host = ["2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:fffe", "2001:db8:1:2:abcd::9%eth0"]
    assert len({lanes._address_of(Raw(ip)) for ip in same_host}) == 1
    assert lanes._address_of(Raw("2001:db8:1:3::1")) != lanes._address_of(Raw(same_host[0]))
    assert lanes._address_of(Raw("::ffff:198.51.100.7")) == lanes._address_of(Raw("198.51.100.7")) is not None
    assert len({caller_address(f"/ip6/{ip.split('%')[0]}/tcp/4001") for ip in same_host}) == 1
    assert caller_address("/ip6/2001:db8:1:3::1/tcp/1") != caller_address("/ip6/2001:db8:1:2::1/tcp/1")
    assert caller_address("/ip6/::ffff:198.51.100.7/tcp/1") == caller_address("/ip4/198.51.100.7/tcp/1")
    assert caller_address("/ip4/127.0.0.1/tcp/1") is None and caller_address("/ip6/::1/tcp/1") is None


def test_a_flood_of_identities_replaces_its_own_tickets_before_anyone_else_s():
    tickets = Tickets()
    honest = {f"QmHonest{i}": tickets.issue(f"QmHonest{i}", f"203.0.113.{i}") for i in range(100)}
    honest["QmLocal"] = tickets.issue("QmLocal", lanes.LOOPBACK)
    for i in range(3 * lanes.MAX_TICKETS):  # fresh identities from one host
        tickets.issue(f"QmSybil{i}", "198.51.100.7")
    assert all(tickets.redeem(ticket) == peer for peer, ticket in honest.items())
    assert len(tickets) == len(honest) + lane_auth.MAX_TICKETS_PER_ADDRESS
    for i in range(3 * lanes.MAX_TICKETS):  # from 200 hosts: the table fills, the biggest holders give way
        tickets.issue(f"QmSybil{i}", f"198.51.100.{i % 200}")
    assert all(tickets.redeem(ticket) == peer for peer, ticket in honest.items())
    assert len(tickets) == lanes.MAX_TICKETS


def test_the_caller_keeps_nothing_for_peers_it_no_longer_calls():
    """Per-peer locks, idle lanes (each a socket and a thread) and open counts go with
    the peer: a caller that has tried thousands of peers (forged records are probed too)
    holds nothing for them."""
    now = [0.0]

    class IdleIO:
        closed = False

        def is_closing(self):
            return self.closed

        def readable_within(self, timeout_s):
            return False

        def close(self):
            self.closed = True

    async def unreachable(peer, timeout_s):
        raise PeerError("no route")

    async def scenario():
        pool = LanePool(unreachable, clock=lambda: now[0])
        for i in range(100):
            assert await pool.take(f"QmGone{i}", 5.0) is None
        ios = [IdleIO() for _ in range(100)]
        for i, io in enumerate(ios):
            pool.give_back(f"QmQuiet{i}", Lane(io, "/ip4/10.0.0.1/tcp/1"))
        now[0] += lanes.CALLER_IDLE_S + 1
        pool.give_back("QmBusy", Lane(IdleIO(), "/ip4/10.0.0.2/tcp/1"))
        return pool, ios

    pool, ios = asyncio.run(scenario())
    assert not pool._locks and not pool._open
    assert list(pool._idle) == ["QmBusy"] and all(io.closed for io in ios)


def test_refused_callers_are_remembered_within_a_bound():
    class FakeP2P:
        peer_id = "QmServer"

        def __init__(self):
            self.handlers = {}

        async def add_binary_stream_handler(self, protocol, handler):
            self.handlers[protocol] = handler

    class Stream:
        def __init__(self, peer):
            self.peer_id, self.addr = peer, "/ip4/198.51.100.7/tcp/4001"

        def close(self):
            pass

    async def scenario():
        p2p = FakeP2P()
        transport = Transport(p2p)
        await transport.serve(CONTROL, None, ServeLimits(max_request_bytes=1024),
                              authorize=lambda peer: False)
        for i in range(lanes.MAX_TICKETS + 1000):  # banned identities, each calling once
            await p2p.handlers[CONTROL](Stream(f"QmBanned{i}"), None, Stream(""))
        return transport

    assert 0 < len(asyncio.run(scenario())._refused) <= lanes.MAX_TICKETS
